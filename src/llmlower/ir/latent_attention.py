"""`latent_attention` and `paged_latent_attention`: multi-head latent attention (DeepSeek's MLA) over a cache of
what DeepSeek caches, per token the compressed latent c_kv (kv_lora_rank wide) and the rotary key k_pe shared by
every head (qk_rope_head_dim wide), instead of keys and values expanded per head.

Every head's key is [W_uk[h] c, k_pe] and its value W_uv[h] c, with kv_weight = [W_uk[0]; W_uv[0]; W_uk[1]; ...]
(kv_b_proj's weight, [heads * (nope + dv), rank]). The op computes the weight-absorbed form: each head's
q_nope is carried into the latent space once (q_nope W_uk[h], [rank]), so the logits are
scale * (q_absorbed . c + q_pe . k_pe) over the cached latents, and the head's output is (probs . c) W_uv[h]^T:
attention with one kv head, keys [c, k_pe] and values c (`attention` / `paged_attention` themselves, the
caches concatenated), between two small matmuls.

Layout (`attention`'s, with one kv head): q [batch, heads, tokens, nope + rope] (q_pe rotated); latent
[batch, 1, tokens, rank] and k_pe [batch, 1, tokens, rope] this step's; SLOTS caches c_cache [batch, 1, context,
rank] and pe_cache [batch, 1, context, rope], or PAGED pools [num_blocks, block_size, 1, rank] and [..., rope]
with block tables (packed tokens, `paged_attention`'s layout). Returns (out [batch, heads, tokens, dv], the
updated caches).
"""

from __future__ import annotations

import torch

from .attention import attention_reference
from .paged_attention import paged_attention
from .registry import NAMESPACE, Cost, OpDef, register_op


def absorbed_query(q: torch.Tensor, kv_weight: torch.Tensor, rope_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q [b, heads, t, nope + rope] -> (the query over [c, k_pe]: [b, heads, t, rank + rope], and W_uv^T per
    head [heads, rank, dv] for the output)."""
    heads, nope = q.shape[1], q.shape[-1] - rope_dim
    weight = kv_weight.reshape(heads, -1, kv_weight.shape[-1])  # [heads, nope + dv, rank]
    q_latent = torch.matmul(q[..., :nope], weight[:, :nope])  # [b, heads, t, rank]
    return torch.cat((q_latent, q[..., nope:]), dim=-1), weight[:, nope:].transpose(1, 2)


def _through_latent(attend, q, latent, k_pe, kv_weight, c_store, pe_store, *rest) -> tuple[torch.Tensor, ...]:
    """`attend` (attention or paged_attention, `rest` its arguments after the caches) with one kv head, keys
    [c, k_pe] and values c, between the absorbed query and W_uv; the stores (caches or pools) split back."""
    rank = latent.shape[-1]
    query, value_weight = absorbed_query(q, kv_weight, k_pe.shape[-1])
    keys, store = torch.cat((latent, k_pe), dim=-1), torch.cat((c_store, pe_store), dim=-1)
    out, store, _ = attend(query, keys, latent, store, c_store, *rest)
    return torch.matmul(out, value_weight), store[..., :rank].clone(), store[..., rank:].clone()


def latent_attention_reference(
    q: torch.Tensor,
    latent: torch.Tensor,
    k_pe: torch.Tensor,
    kv_weight: torch.Tensor,
    c_cache: torch.Tensor,
    pe_cache: torch.Tensor,
    past_lens: torch.Tensor,
    input_lens: torch.Tensor,
    scale: float,
    window: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _through_latent(
        attention_reference, q, latent, k_pe, kv_weight, c_cache, pe_cache, past_lens, input_lens, scale, window
    )


latent_attention = torch.library.custom_op(
    f"{NAMESPACE}::latent_attention", latent_attention_reference, mutates_args=()
)


@latent_attention.register_fake
def _latent_attention_fake(q, latent, k_pe, kv_weight, c_cache, pe_cache, past_lens, input_lens, scale, window=0):
    value_dim = kv_weight.shape[0] // q.shape[1] - (q.shape[-1] - k_pe.shape[-1])
    return q.new_empty((*q.shape[:3], value_dim)), torch.empty_like(c_cache), torch.empty_like(pe_cache)


@torch.library.custom_op(f"{NAMESPACE}::paged_latent_attention", mutates_args=())
def paged_latent_attention(
    q: torch.Tensor,
    latent: torch.Tensor,
    k_pe: torch.Tensor,
    kv_weight: torch.Tensor,
    c_pool: torch.Tensor,
    pe_pool: torch.Tensor,
    block_tables: torch.Tensor,
    past_lens: torch.Tensor,
    input_lens: torch.Tensor,
    scale: float,
    window: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _through_latent(
        paged_attention, q, latent, k_pe, kv_weight, c_pool, pe_pool, block_tables, past_lens, input_lens, scale, window
    )


@paged_latent_attention.register_fake
def _paged_latent_attention_fake(
    q, latent, k_pe, kv_weight, c_pool, pe_pool, block_tables, past_lens, input_lens, scale, window=0
):
    return _latent_attention_fake(q, latent, k_pe, kv_weight, c_pool, pe_pool, past_lens, input_lens, scale)


def latent_attention_cost(
    batch: int,
    tokens: int,
    heads: int,
    rank: int,
    rope_dim: int,
    nope_dim: int,
    value_head_dim: int,
    context: int,
    element_bytes: int,
) -> Cost:
    """The absorption (q_nope W_uk, [nope] -> [rank] per head and token), logits over [rank + rope] and the
    latent sum over [rank] for `context` keys per query, the output matmul ([rank] -> [dv]); reads kv_b_proj's
    weight once, the cache's `context` latents and rotary keys (one head) and writes the new ones."""
    rows = batch * heads * tokens
    flops = 2 * rows * (nope_dim * rank + context * (2 * rank + rope_dim) + rank * value_head_dim)
    width = rank + rope_dim
    weight_bytes = element_bytes * heads * (nope_dim + value_head_dim) * rank
    cache_reads = element_bytes * batch * context * width
    cache_writes = element_bytes * batch * tokens * width
    activations = element_bytes * (rows * (nope_dim + rope_dim + value_head_dim) + batch * tokens * width)
    return Cost(
        flops=flops,
        bytes=activations + weight_bytes + cache_reads + cache_writes,
        weight_bytes=weight_bytes,
        kv_read_bytes=cache_reads,
        kv_write_bytes=cache_writes,
    )


LATENT_ATTENTION = register_op(
    OpDef(
        name="latent_attention",
        op=torch.ops.llmlower.latent_attention,
        summary="multi-head latent attention (MLA) over a cache of latents and rotary keys, weight-absorbed",
        cost=latent_attention_cost,
        reference=latent_attention_reference,
    )
)
PAGED_LATENT_ATTENTION = register_op(
    OpDef(
        name="paged_latent_attention",
        op=torch.ops.llmlower.paged_latent_attention,
        summary="latent_attention over block pools of latents and rotary keys addressed by block tables",
        cost=latent_attention_cost,
    )
)
