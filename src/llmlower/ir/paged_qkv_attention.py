"""`paged_qkv_attention`: `qkv_attention` over block pools (the PAGED layout of `paged_attention`).

qkv is [1, tokens, (heads + kv_heads) * dk + kv_heads * dv], the step's tokens packed one sequence after another;
each token is rotated for its position in its sequence (past_lens[s] + t) with the rows of cos_table /
sin_table, then attends as `paged_attention` does. Returns (out [1, tokens, heads * dv], updated
k_pool, updated v_pool). This is ONNX Runtime's PagedAttention with packed qkv and do_rotary.
"""

from __future__ import annotations

import torch

from .paged_attention import packed_positions
from .qkv_attention import qkv_attention_cost, split_heads
from .registry import NAMESPACE, OpDef, register_op


@torch.library.custom_op(f"{NAMESPACE}::paged_qkv_attention", mutates_args=())
def paged_qkv_attention(
    qkv: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
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
    tokens = qkv.shape[1]
    q, k, v = split_heads(qkv, heads, kv_heads, k_pool.shape[-1], v_pool.shape[-1])
    positions = torch.zeros(tokens, dtype=torch.int64, device=qkv.device)
    _, real = packed_positions(past_lens, input_lens)
    positions[: len(real)] = real.clamp(max=cos_table.shape[0] - 1)
    cos, sin = (torch.cat((t[positions], t[positions]), dim=-1)[None, None] for t in (cos_table, sin_table))
    q, k = torch.ops.llmlower.rope(q, cos, sin), torch.ops.llmlower.rope(k, cos, sin)
    out, k_pool, v_pool = torch.ops.llmlower.paged_attention(
        q, k, v, k_pool, v_pool, block_tables, past_lens, input_lens, scale, window, softcap, sinks, alibi_slopes,
        k_scale, v_scale,
    )  # fmt: skip
    return out.transpose(1, 2).reshape(1, tokens, -1), k_pool, v_pool


@paged_qkv_attention.register_fake
def _paged_qkv_attention_fake(
    qkv,
    k_pool,
    v_pool,
    block_tables,
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
    out = qkv.new_empty((qkv.shape[0], qkv.shape[1], heads * v_pool.shape[-1]))
    return out, torch.empty_like(k_pool), torch.empty_like(v_pool)


PAGED_QKV_ATTENTION = register_op(
    OpDef(
        name="paged_qkv_attention",
        op=torch.ops.llmlower.paged_qkv_attention,
        summary="rotary + paged attention over a fused qkv projection, block pools",
        cost=qkv_attention_cost,
    )
)
