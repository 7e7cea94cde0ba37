"""`attention`: causal attention of a step's new tokens over a KV cache that stores only the kv heads.

Layout (the one ONNX Runtime's GroupQueryAttention and SDPA use): q is [batch, heads, tokens, head_dim];
k and v are this step's keys and values, [batch, kv_heads, tokens, head_dim], not repeated per query head;
k_cache and v_cache are [batch, kv_heads, context, head_dim]. Sequence b already holds past_lens[b]
tokens in the cache and brings input_lens[b] new ones, right-padded to `tokens`; new token t sits at
position past_lens[b] + t. The op writes the valid new k/v into the cache at those positions and returns
(out [batch, heads, tokens, head_dim], updated k_cache, updated v_cache). Query t attends to cache
positions j <= past_lens[b] + t (and j > that - window when window > 0). Outputs at padded query
positions are unspecified. Prefill (past_lens = 0) and decode (tokens = 1) are the same op.
"""

from __future__ import annotations

import torch

from .registry import NAMESPACE, Cost, OpDef, register_op


def visible(keys: torch.Tensor, positions: torch.Tensor, window: int = 0) -> torch.Tensor:
    """Which cache positions `keys` a query at `positions` attends to (broadcast): causal, and within the
    sliding window when window > 0."""
    allowed = keys <= positions
    return allowed & (keys > positions - window) if window > 0 else allowed


@torch.library.custom_op(f"{NAMESPACE}::attention", mutates_args=())
def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    past_lens: torch.Tensor,
    input_lens: torch.Tensor,
    scale: float,
    window: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    tokens, context = q.shape[2], k_cache.shape[2]
    totals = past_lens + input_lens
    used = int(totals.max())
    if used > context:
        raise ValueError(f"attention: {used} tokens do not fit a KV cache of {context} positions")

    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    for row, (past, count) in enumerate(zip(past_lens.tolist(), input_lens.tolist(), strict=True)):
        k_cache[row, :, past : past + count] = k[row, :, :count]
        v_cache[row, :, past : past + count] = v[row, :, :count]

    positions = past_lens[:, None] + torch.arange(tokens, device=q.device)  # [batch, tokens]
    keys = torch.arange(used, device=q.device)
    allowed = visible(keys, positions[:, :, None], window) & (keys < totals[:, None, None])  # [batch, tokens, used]
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k_cache[:, :, :used], v_cache[:, :, :used], attn_mask=allowed[:, None], scale=scale, enable_gqa=True
    )
    return out, k_cache, v_cache


@attention.register_fake
def _attention_fake(q, k, v, k_cache, v_cache, past_lens, input_lens, scale, window=0):
    return torch.empty_like(q), torch.empty_like(k_cache), torch.empty_like(v_cache)


def attention_cost(
    batch: int, tokens: int, heads: int, kv_heads: int, head_dim: int, context: int, element_bytes: int
) -> Cost:
    """QK^T and PV over `context` keys per query (the full matrix, masked or not); reads q and the new k/v,
    writes the output; reads the kv-heads cache's `context` positions once and writes the new k/v into it."""
    flops = 4 * batch * heads * tokens * context * head_dim
    activations = 2 * batch * tokens * heads * head_dim + 2 * batch * tokens * kv_heads * head_dim
    cache_reads = element_bytes * 2 * batch * kv_heads * context * head_dim
    cache_writes = element_bytes * 2 * batch * tokens * kv_heads * head_dim
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
    )
)
