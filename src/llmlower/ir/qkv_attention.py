"""`qkv_attention`: `attention` fed straight from a fused q|k|v projection, rotary embedding applied inside.

qkv is [batch, tokens, (heads + kv_heads) * dk + kv_heads * dv], the output of one projection (q, then k, then
v; dk and dv the caches' head sizes); the op returns (out [batch, tokens, heads * dv], updated k_cache,
updated v_cache), the layout the output projection reads. softcap, sinks, alibi_slopes and an int8 cache's
k_scale / v_scale are `attention`'s. New
token t of sequence b is rotated for position past_lens[b] + t with the rows of cos_table / sin_table [positions,
head_dim / 2] (rotate_half layout: both halves of a head share them). This is what ONNX Runtime's
GroupQueryAttention (packed qkv, do_rotary) and TVM's paged KV cache (attention with fused qkv) compute in one
kernel; otherwise it is `rope` + `attention` (ir/attention.py).
"""

from __future__ import annotations

import torch

from .attention import attention_cost
from .registry import NAMESPACE, Cost, OpDef, register_op
from .rope import rope_cost


def split_heads(
    qkv: torch.Tensor, heads: int, kv_heads: int, head_dim: int, value_head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [batch, heads, tokens, head_dim], k [batch, kv_heads, tokens, head_dim] and v [batch, kv_heads, tokens,
    value_head_dim] of a fused projection."""
    batch, tokens, _ = qkv.shape
    widths = [heads * head_dim, kv_heads * head_dim, kv_heads * value_head_dim]
    dims = [head_dim, head_dim, value_head_dim]
    parts = qkv.split(widths, dim=-1)
    return tuple(p.reshape(batch, tokens, -1, d).transpose(1, 2) for p, d in zip(parts, dims, strict=True))


def qkv_attention_reference(
    qkv: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    past_lens: torch.Tensor,
    input_lens: torch.Tensor,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    heads: int,
    kv_heads: int,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    batch, tokens, _ = qkv.shape
    q, k, v = split_heads(qkv, heads, kv_heads, k_cache.shape[-1], v_cache.shape[-1])
    positions = past_lens[:, None] + torch.arange(tokens, device=qkv.device)
    positions = positions.clamp(max=cos_table.shape[0] - 1)  # padded tokens may run past the table
    cos, sin = (torch.cat((t[positions], t[positions]), dim=-1)[:, None] for t in (cos_table, sin_table))
    q, k = torch.ops.llmlower.rope(q, cos, sin), torch.ops.llmlower.rope(k, cos, sin)
    out, k_cache, v_cache = torch.ops.llmlower.attention(
        q, k, v, k_cache, v_cache, past_lens, input_lens, scale, window, softcap, sinks, alibi_slopes, k_scale, v_scale
    )
    return out.transpose(1, 2).reshape(batch, tokens, -1), k_cache, v_cache


qkv_attention = torch.library.custom_op(f"{NAMESPACE}::qkv_attention", qkv_attention_reference, mutates_args=())


@qkv_attention.register_fake
def _qkv_attention_fake(
    qkv,
    k_cache,
    v_cache,
    past_lens,
    input_lens,
    cos_table,
    sin_table,
    heads,
    kv_heads,
    scale,
    window=0,
    softcap=0.0,
    sinks=None,
    alibi_slopes=None,
    k_scale=None,
    v_scale=None,
):
    out = qkv.new_empty((qkv.shape[0], qkv.shape[1], heads * v_cache.shape[-1]))
    return out, torch.empty_like(k_cache), torch.empty_like(v_cache)


def qkv_attention_cost(
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
    """`attention` plus rotating the new q and k."""
    rotated = batch * tokens * (heads + kv_heads) * head_dim
    attention = attention_cost(
        batch, tokens, heads, kv_heads, head_dim, context, element_bytes, value_head_dim, softcap, alibi,
        cache_element_bytes,
    )  # fmt: skip
    return attention + rope_cost(rotated, element_bytes)


QKV_ATTENTION = register_op(
    OpDef(
        name="qkv_attention",
        op=torch.ops.llmlower.qkv_attention,
        summary="rotary + attention over a fused qkv projection, kv-heads cache",
        cost=qkv_attention_cost,
        reference=qkv_attention_reference,
    )
)
