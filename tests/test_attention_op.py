"""The `attention` op's reference implementation against SDPA over explicitly repeated heads."""

from __future__ import annotations

import pytest
import torch

from llmlower.ir import ATTENTION

HEADS, KV_HEADS, DIM, CONTEXT = 6, 2, 8, 20


def _sdpa_reference(q, k_all, v_all, position, window):
    """One sequence: q [heads, 1, dim] at `position`, keys/values [kv_heads, position+1, dim]."""
    k = k_all.repeat_interleave(HEADS // KV_HEADS, dim=0)
    v = v_all.repeat_interleave(HEADS // KV_HEADS, dim=0)
    mask = torch.ones(1, k.shape[1], dtype=torch.bool)
    if window:
        mask[0, : max(0, position + 1 - window)] = False
    return torch.nn.functional.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask)[0]


@pytest.mark.parametrize("window", [0, 3])
def test_attention_appends_to_cache_and_attends_causally(window):
    gen = torch.Generator().manual_seed(0)
    past = torch.tensor([0, 4, 9])
    lens = torch.tensor([5, 2, 1])
    batch, tokens = 3, 5
    q = torch.randn(batch, HEADS, tokens, DIM, generator=gen)
    k = torch.randn(batch, KV_HEADS, tokens, DIM, generator=gen)
    v = torch.randn(batch, KV_HEADS, tokens, DIM, generator=gen)
    k_cache = torch.randn(batch, KV_HEADS, CONTEXT, DIM, generator=gen)
    v_cache = torch.randn(batch, KV_HEADS, CONTEXT, DIM, generator=gen)
    out, k_new, v_new = ATTENTION.op(q, k, v, k_cache, v_cache, past, lens, DIM**-0.5, window)

    for b in range(batch):
        p, n = int(past[b]), int(lens[b])
        torch.testing.assert_close(k_new[b, :, p : p + n], k[b, :, :n])
        torch.testing.assert_close(v_new[b, :, p : p + n], v[b, :, :n])
        torch.testing.assert_close(k_new[b, :, :p], k_cache[b, :, :p])  # the past is untouched
        torch.testing.assert_close(k_new[b, :, p + n :], k_cache[b, :, p + n :])  # so is what lies beyond
        for t in range(n):
            expected = _sdpa_reference(
                q[b, :, t : t + 1], k_new[b, :, : p + t + 1], v_new[b, :, : p + t + 1], p + t, window
            )
            torch.testing.assert_close(out[b, :, t : t + 1], expected, atol=1e-5, rtol=1e-5)


def test_attention_refuses_a_cache_too_small():
    q = torch.zeros(1, HEADS, 3, DIM)
    kv = torch.zeros(1, KV_HEADS, 3, DIM)
    cache = torch.zeros(1, KV_HEADS, 4, DIM)
    with pytest.raises(ValueError, match="do not fit a KV cache of 4 positions"):
        ATTENTION.op(q, kv, kv, cache, cache, torch.tensor([2]), torch.tensor([3]), 1.0, 0)


def test_cost_counts_kv_heads_only():
    gqa = ATTENTION.cost(batch=1, tokens=1, heads=9, kv_heads=3, head_dim=64, context=100, element_bytes=2)
    mha = ATTENTION.cost(batch=1, tokens=1, heads=9, kv_heads=9, head_dim=64, context=100, element_bytes=2)
    assert gqa.flops == mha.flops == 4 * 9 * 100 * 64
    assert gqa.bytes < mha.bytes
    assert gqa.kv_read_bytes == 2 * 2 * 3 * 100 * 64 and gqa.kv_write_bytes == 2 * 2 * 3 * 64
    assert gqa.bytes == 2 * (2 * 9 * 64 + 2 * 3 * 64) + gqa.kv_read_bytes + gqa.kv_write_bytes
