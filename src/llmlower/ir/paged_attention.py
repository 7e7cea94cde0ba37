"""`paged_attention`: `attention` over a pool of fixed-size KV blocks addressed by block tables.

The step's tokens are packed: q is [1, heads, tokens, head_dim] and k, v are [1, kv_heads, tokens, head_dim]
(kv heads only), holding sequence 0's input_lens[0] new tokens, then sequence 1's, and so on. The pools are
[num_blocks, block_size, kv_heads, head_dim]; position p of sequence s lives in block block_tables[s, p //
block_size] at offset p % block_size. New token t of sequence s sits at position past_lens[s] + t: the op
writes its k/v into the pools there and returns (out [1, heads, tokens, head_dim], updated k_pool, updated
v_pool), each new token attending to its own sequence's positions j <= its own (and j > that - window when
window > 0), with `attention`'s extras (softcap, sinks, ALiBi slopes, a value head size of its own: v_pool is then
[num_blocks, block_size, kv_heads, dv]). Sequences may share blocks (a cached prefix) and blocks may sit
anywhere in the pool; a step never writes a block another sequence reads (the runtime's block manager copies a
shared block first). An int8 pool comes with `attention`'s k_scale / v_scale ([1, kv_heads, 1, head_dim]).
"""

from __future__ import annotations

import torch

from .attention import alibi_bias, attend, attention_cost, dequantize_kv, quantize_kv, visible
from .registry import NAMESPACE, OpDef, register_op


def pool_scale(scale: torch.Tensor | None) -> torch.Tensor | None:
    """An int8 cache's [1, kv_heads, 1, head_dim] scale as [kv_heads, head_dim], to broadcast over a pool's
    [.., kv_heads, head_dim]."""
    return None if scale is None else scale.reshape(scale.shape[1], scale.shape[3])


def packed_positions(past_lens: torch.Tensor, input_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For packed tokens: each token's sequence index and its position in that sequence."""
    sequence = torch.repeat_interleave(torch.arange(len(input_lens), device=input_lens.device), input_lens)
    starts = torch.cumsum(input_lens, 0) - input_lens
    offset = torch.arange(len(sequence), device=input_lens.device) - starts[sequence]
    return sequence, past_lens[sequence] + offset


@torch.library.custom_op(f"{NAMESPACE}::paged_attention", mutates_args=())
def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
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
    block_size = k_pool.shape[1]
    k_scale, v_scale = pool_scale(k_scale), pool_scale(v_scale)
    sequence, positions = packed_positions(past_lens, input_lens)
    if positions.numel() and int(positions.max()) >= block_tables.shape[1] * block_size:
        raise ValueError(f"paged_attention: position {int(positions.max())} is beyond the sequence's block table")
    k_pool, v_pool = k_pool.clone(), v_pool.clone()
    count = len(sequence)
    blocks = block_tables[sequence, positions // block_size]
    k_pool[blocks, positions % block_size] = quantize_kv(k[0, :, :count].transpose(0, 1), k_scale, k_pool.dtype)
    v_pool[blocks, positions % block_size] = quantize_kv(v[0, :, :count].transpose(0, 1), v_scale, v_pool.dtype)

    out = q.new_zeros((*q.shape[:3], v.shape[-1]))
    start = 0
    for row, (past, new) in enumerate(zip(past_lens.tolist(), input_lens.tolist(), strict=True)):
        keys = torch.arange(past + new, device=q.device)
        where = block_tables[row, keys // block_size], keys % block_size
        k_seq, v_seq = (
            dequantize_kv(pool[where], pool_scale, q.dtype).permute(1, 0, 2)[None]  # [1, kv_heads, keys, D]
            for pool, pool_scale in ((k_pool, k_scale), (v_pool, v_scale))
        )
        positions = past + torch.arange(new, device=q.device)[:, None]
        allowed = visible(keys[None, :], positions, window)
        bias = alibi_bias(alibi_slopes, keys[None, :], positions)
        out[:, :, start : start + new] = attend(
            q[:, :, start : start + new], k_seq, v_seq, allowed[None, None], scale, softcap, sinks, bias
        )
        start += new
    return out, k_pool, v_pool


@paged_attention.register_fake
def _paged_attention_fake(
    q,
    k,
    v,
    k_pool,
    v_pool,
    block_tables,
    past_lens,
    input_lens,
    scale,
    window=0,
    softcap=0.0,
    sinks=None,
    alibi_slopes=None,
    k_scale=None,
    v_scale=None,
):
    return q.new_empty((*q.shape[:3], v.shape[-1])), torch.empty_like(k_pool), torch.empty_like(v_pool)


PAGED_ATTENTION = register_op(
    OpDef(
        name="paged_attention",
        op=torch.ops.llmlower.paged_attention,
        summary="causal attention over a pool of KV blocks addressed by block tables, appending this step's k/v",
        cost=attention_cost,
    )
)
