"""`attention`: causal attention of a step's new tokens over a KV cache that stores only the kv heads.

Layout (the one ONNX Runtime's GroupQueryAttention and SDPA use): q is [batch, heads, tokens, head_dim];
k and v are this step's keys and values, [batch, kv_heads, tokens, head_dim], not repeated per query head;
k_cache and v_cache are [batch, kv_heads, context, head_dim]. Sequence b already holds past_lens[b]
tokens in the cache and brings input_lens[b] new ones, right-padded to `tokens`; new token t sits at
position past_lens[b] + t. The op writes the valid new k/v into the cache at those positions and returns
(out [batch, heads, tokens, head_dim], updated k_cache, updated v_cache). Query t attends to cache
positions j <= past_lens[b] + t (and j > that - window when window > 0; when window < 0, chunked local
attention, only its own chunk's: j >= p - p % -window for p = past_lens[b] + t). Outputs at padded query
positions are unspecified. Prefill (past_lens = 0) and decode (tokens = 1) are the same op.

The extras some models need, each off by default (`attend`): `softcap` > 0 caps the scaled logits at
softcap * tanh(logit / softcap) (Gemma 2); `sinks` [heads] are learned logits of a key nobody sees, one per
head, that take a share of the softmax (gpt-oss); values may have a head size of their own (v, v_cache and
out then end in it; DeepSeek's MLA), `scale` is whatever the model scales q·k by, and `alibi_slopes` [heads]
add slope_h * (key position - query position) to head h's logits (ALiBi: Bloom, MPT, Falcon with alibi; the
models write slope_h * key position, which is the same softmax, as it shifts each row by a constant).

A cache may be in a narrower float dtype than q (the kv_cache_dtype pass: float16 for a float32 model): new keys
and values are cast to it, and read back cast to q's. An int8 cache (the same pass) comes with `k_scale` and
`v_scale` [1, kv_heads, 1, head_dim], float32: the new keys and values are written as round(x / scale) clamped to
[-128, 127], and the cache is read as int8 * scale (one scale per kv head and channel, fixed at compile time; ONNX
Runtime's GroupQueryAttention PER_CHANNEL quantization).
"""

from __future__ import annotations

import torch

from .registry import NAMESPACE, Cost, OpDef, register_op


def visible(keys: torch.Tensor, positions: torch.Tensor, window: int = 0) -> torch.Tensor:
    """Which cache positions `keys` a query at `positions` attends to (broadcast): causal, and within the
    sliding window when window > 0, or within its own chunk of -window positions when window < 0 (Llama 4's
    chunked local attention: positions c·chunk .. (c+1)·chunk - 1 see only each other)."""
    allowed = keys <= positions
    if window > 0:
        return allowed & (keys > positions - window)
    if window < 0:
        return allowed & (keys >= positions - positions % -window)
    return allowed


def alibi_bias(slopes: torch.Tensor | None, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
    """ALiBi's additive logits, float32: slopes [heads] times (keys - positions), broadcast as `visible`'s
    arguments and with a heads dimension before their last two (keys [.., 1, ctx], positions [.., tokens, 1]
    -> [.., heads, tokens, ctx]); None without slopes."""
    if slopes is None:
        return None
    distance = (keys - positions).float().unsqueeze(-3)
    return slopes.float().reshape(-1, 1, 1) * distance


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor,
    scale: float,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax over the allowed keys of the scaled (and soft-capped) logits plus `bias` (ALiBi's, float32), with
    each head's sink logit as an extra column dropped after the softmax, times v: transformers' eager attention of
    Gemma 2, gpt-oss and Bloom. q [batch, heads, tokens, dk], k [batch, kv_heads, keys, dk], v [batch, kv_heads,
    keys, dv], allowed and bias broadcast to [batch, heads, tokens, keys]; returns [batch, heads, tokens, dv].
    Without extras it is SDPA itself."""
    if not softcap and sinks is None and bias is None:
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=allowed, scale=scale, enable_gqa=True
        )
    group = q.shape[1] // k.shape[1]
    k, v = (x.unsqueeze(2).expand(-1, -1, group, -1, -1).flatten(1, 2) for x in (k, v))  # repeat kv heads
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    if bias is not None:
        scores = scores + bias
    scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)  # finite: a padded row gives no NaN
    if sinks is not None:
        column = sinks.float().reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        weights = torch.softmax(torch.cat((scores, column), dim=-1), dim=-1)[..., :-1]
    else:
        weights = torch.softmax(scores, dim=-1)
    return torch.matmul(weights.to(v.dtype), v)


def quantize_kv(x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """x as a cache of `dtype` stores it: cast to a float cache's dtype, or int8 steps of `scale` (rounded,
    saturated to int8's range)."""
    if scale is None:
        return x.to(dtype)
    return torch.clamp(torch.round(x.float() / scale), -128, 127).to(torch.int8)


def dequantize_kv(cache: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The cache's values in `dtype`: a float cache's cast, or its int8 steps times `scale`."""
    return cache.to(dtype) if scale is None else (cache.float() * scale).to(dtype)


def _take_tokens(x: torch.Tensor, index: torch.Tensor, context: int) -> torch.Tensor:
    """[batch, kv_heads, context, head_dim]: token index[b * context + j] of x (its tokens flattened over rows)."""
    batch, kv_heads, tokens, head_dim = x.shape  # (head_dim: k's or v's own)
    flat = x.transpose(1, 2).reshape(batch * tokens, kv_heads, head_dim)
    return flat.index_select(0, index).reshape(batch, context, kv_heads, head_dim).transpose(1, 2)


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    past_lens: torch.Tensor,
    input_lens: torch.Tensor,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    tokens, context = q.shape[2], k_cache.shape[2]
    totals = past_lens + input_lens
    if not torch.compiler.is_compiling() and int(totals.max()) > context:  # eager only: a trace has no values
        raise ValueError(f"attention: {int(totals.max())} tokens do not fit a KV cache of {context} positions")

    # tensorised (no loop over sequences, so it traces): cache position j of sequence b takes new token
    # j - past_lens[b] where that is one of its input_lens[b] tokens, and keeps its old value elsewhere
    keys = torch.arange(context, device=q.device)
    source = keys - past_lens[:, None]  # [batch, context]
    written = ((source >= 0) & (source < input_lens[:, None]))[:, None, :, None]
    rows = torch.arange(q.shape[0], device=q.device)[:, None] * tokens  # the new tokens of all rows, flattened:
    index = (rows + source.clamp(0, tokens - 1)).flatten()  # a [batch * context] index (a small constant if static)
    k_cache = torch.where(written, _take_tokens(quantize_kv(k, k_scale, k_cache.dtype), index, context), k_cache)
    v_cache = torch.where(written, _take_tokens(quantize_kv(v, v_scale, v_cache.dtype), index, context), v_cache)

    positions = past_lens[:, None] + torch.arange(tokens, device=q.device)  # [batch, tokens]
    allowed = visible(keys, positions[:, :, None], window) & (keys < totals[:, None, None])  # [batch, tokens, ctx]
    bias = alibi_bias(alibi_slopes, keys, positions[:, :, None])
    keys_read, values_read = dequantize_kv(k_cache, k_scale, q.dtype), dequantize_kv(v_cache, v_scale, q.dtype)
    out = attend(q, keys_read, values_read, allowed[:, None], scale, softcap, sinks, bias)
    return out, k_cache, v_cache


attention = torch.library.custom_op(f"{NAMESPACE}::attention", attention_reference, mutates_args=())


@attention.register_fake
def _attention_fake(
    q, k, v, k_cache, v_cache, past_lens, input_lens, scale, window=0, softcap=0.0, sinks=None, alibi_slopes=None,
    k_scale=None, v_scale=None,
):  # fmt: skip
    return q.new_empty((*q.shape[:3], v.shape[-1])), torch.empty_like(k_cache), torch.empty_like(v_cache)


def attention_cost(
    batch: int,
    tokens: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    context: int,
    element_bytes: int,
    value_head_dim: int | None = None,
    softcap: bool = False,
    alibi: bool = False,
    cache_element_bytes: int | None = None,
) -> Cost:
    """QK^T (head_dim) and PV (value_head_dim, head_dim unless given) over `context` keys per query (the full
    matrix, masked or not; softcap adds a divide, tanh and multiply per logit, ALiBi a subtract, multiply and
    add); reads q and the new k/v, writes the output; reads the kv-heads cache's `context` positions once and
    writes the new k/v into it, in the cache's element size (the activations' unless given: an int8 cache's 1)."""
    dims = head_dim + (value_head_dim or head_dim)  # a key's and a value's elements
    logits = batch * heads * tokens * context
    flops = 2 * logits * dims + (3 * logits if softcap else 0) + (3 * logits if alibi else 0)
    activations = batch * tokens * heads * dims + batch * tokens * kv_heads * dims
    cache_bytes = cache_element_bytes or element_bytes
    cache_reads = cache_bytes * batch * kv_heads * context * dims
    cache_writes = cache_bytes * batch * tokens * kv_heads * dims
    return Cost(
        flops=flops,
        bytes=element_bytes * activations + cache_reads + cache_writes,
        kv_read_bytes=cache_reads,
        kv_write_bytes=cache_writes,
    )


ATTENTION = register_op(
    OpDef(
        name="attention",
        op=torch.ops.llmlower.attention,
        summary="causal attention over a kv-heads-only KV cache, appending this step's k/v",
        cost=attention_cost,
        reference=attention_reference,
    )
)
