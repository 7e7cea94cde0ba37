"""Captured + rewritten programs reproduce transformers' eager logits through prefill and decode."""

from __future__ import annotations

import pytest
import torch

from llmlower.frontend import capture, load
from llmlower.ir.program import cache_names, example_inputs
from llmlower.passes import FUSION, run_pipeline
from llmlower.passes.kv_cache import SDPA

ARCHS = ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gpt2"]
PROMPT_LENS = [5, 9, 3]
DECODE_STEPS = 8
CONTEXT = 24

# Ops transformers uses to build attention masks (causal, sliding window, packed-sequence detection).
MASK_OPS = {
    torch.ops.aten.le.Tensor,
    torch.ops.aten.lt.Tensor,
    torch.ops.aten.ge.Tensor,
    torch.ops.aten.gt.Tensor,
    torch.ops.aten.le.Scalar,
    torch.ops.aten.lt.Scalar,
    torch.ops.aten.gt.Scalar,
    torch.ops.aten.ge.Scalar,
    torch.ops.aten.eq.Tensor,
    torch.ops.aten.ne.Scalar,
    torch.ops.aten.__and__.Tensor,
    torch.ops.aten.__or__.Tensor,
    torch.ops.aten.diff.default,
    torch.ops.aten.cumsum.default,
    torch.ops.aten.arange.default,
    torch.ops.aten.arange.start,
    torch.ops.aten.tril.default,
    torch.ops.aten.triu.default,
    torch.ops.aten.new_ones.default,
    torch.ops.aten.where.self,
    torch.ops.aten.masked_fill.Scalar,
}


@pytest.fixture(scope="module", params=ARCHS)
def rewritten(request, tiny_checkpoints):
    loaded = load(tiny_checkpoints[request.param])
    program = run_pipeline(capture(loaded), ["canonicalize", *FUSION, "kv_cache"], verify=True)
    return loaded, program


def _reference_logits(module: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return module(input_ids=tokens[None]).logits[0]


def test_prefill_and_decode_match_transformers(rewritten):
    loaded, program = rewritten
    spec = program.spec
    gen = torch.Generator().manual_seed(0)
    sequences = [torch.randint(5, spec.vocab_size, (n + DECODE_STEPS,), generator=gen) for n in PROMPT_LENS]
    references = [_reference_logits(loaded.module, s) for s in sequences]
    batch = len(sequences)
    caches = {
        t.name: torch.zeros(batch, spec.num_kv_heads, CONTEXT, spec.head_dim)
        for t in program.inputs
        if t.name.startswith(("k_cache", "v_cache"))
    }

    # Prefill: prompts of different lengths, right-padded into one batch.
    width = max(PROMPT_LENS)
    ids = torch.zeros(batch, width, dtype=torch.long)
    for row, (seq, n) in enumerate(zip(sequences, PROMPT_LENS, strict=True)):
        ids[row, :n] = seq[:n]
    lens = torch.tensor(PROMPT_LENS)
    out = program(
        input_ids=ids,
        position_ids=torch.arange(width).expand(batch, width).contiguous(),
        past_lens=torch.zeros(batch, dtype=torch.long),
        input_lens=lens,
        **caches,
    )
    for row, n in enumerate(PROMPT_LENS):
        torch.testing.assert_close(out["logits"][row, :n], references[row][:n], atol=1e-4, rtol=0)
    caches = {name: out[name] for name in caches}

    # Decode: one token per sequence, each at its own past length.
    for step in range(DECODE_STEPS):
        past = lens + step
        tokens = torch.stack([seq[p] for seq, p in zip(sequences, past.tolist(), strict=True)])[:, None]
        out = program(
            input_ids=tokens,
            position_ids=past[:, None],
            past_lens=past,
            input_lens=torch.ones(batch, dtype=torch.long),
            **caches,
        )
        for row, p in enumerate(past.tolist()):
            torch.testing.assert_close(out["logits"][row, 0], references[row][p], atol=1e-4, rtol=0)
        caches = {name: out[name] for name in caches}


def test_cache_holds_only_kv_heads_and_matches_transformers_cache(rewritten):
    loaded, program = rewritten
    spec = program.spec
    k_name, v_name = cache_names(0)
    k_spec = next(t for t in program.inputs if t.name == k_name)
    assert k_spec.shape == ("batch", spec.num_kv_heads, "context", spec.head_dim)

    tokens = torch.arange(10, 17)
    caches = {t.name: torch.zeros(1, spec.num_kv_heads, 8, spec.head_dim) for t in program.inputs[4:]}
    out = program(
        input_ids=tokens[None],
        position_ids=torch.arange(7)[None],
        past_lens=torch.tensor([0]),
        input_lens=torch.tensor([7]),
        **caches,
    )
    assert out[k_name].shape[1] == spec.num_kv_heads
    with torch.no_grad():
        hf_cache = loaded.module(input_ids=tokens[None], use_cache=True).past_key_values
    hf_keys, hf_values = hf_cache.layers[0].keys, hf_cache.layers[0].values
    kept = hf_keys.shape[2]  # a sliding-window layer keeps only the last tokens
    torch.testing.assert_close(out[k_name][:, :, 7 - kept : 7], hf_keys, atol=1e-5, rtol=0)
    torch.testing.assert_close(out[v_name][:, :, 7 - kept : 7], hf_values, atol=1e-5, rtol=0)


def test_no_sdpa_and_no_mask_construction_after_kv_cache(rewritten):
    _, program = rewritten
    targets = {n.target for n in program.graph_module.graph.nodes if n.op == "call_function"}
    assert SDPA not in targets
    assert not targets & MASK_OPS, f"mask ops left: {targets & MASK_OPS}"
    assert torch.ops.llmlower.attention.default in targets
    record = {r.name: r for r in program.history}
    assert record["kv_cache"].stats["matches"] == program.spec.num_layers
    assert record["kv_cache"].max_error is not None and record["kv_cache"].max_error < 1e-5


def test_rewritten_program_still_exports(rewritten):
    """Backends re-export the rewritten graph: it must export, and compute the same outputs after."""
    _, program = rewritten
    inputs = example_inputs(program, batch=2, tokens=4, context=12, past_max=8, seed=3)
    expected = program(**inputs)
    reexported = program.reexport()
    assert reexported.fresh_meta
    actual = reexported(**inputs)
    for name, value in expected.items():
        torch.testing.assert_close(actual[name], value, atol=1e-6, rtol=0)
