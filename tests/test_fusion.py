"""Fusion passes: same logits as the unfused program, the expected matches, and the fused graph shape."""

from __future__ import annotations

import pytest
import torch

from llmlower.ir import ROPE, SILU_MUL
from llmlower.ir.program import example_inputs, fetch_attr
from llmlower.passes import FUSION, run_pipeline

ARCHS = ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gpt2"]
LLAMA_FAMILY = ["llama", "mistral", "qwen2", "qwen3"]
LINEAR = torch.ops.aten.linear.default


@pytest.fixture(scope="module", params=ARCHS)
def pair(request, captures):
    """(arch, unfused program, fused program), both with a KV cache."""
    unfused = run_pipeline(captures(request.param), ["canonicalize", "kv_cache"])
    fused = run_pipeline(captures(request.param), ["canonicalize", *FUSION, "kv_cache"], verify=True)
    return request.param, unfused, fused


def _stats(program, name):
    return next(r.stats for r in program.history if r.name == name)


def test_fused_logits_equal_unfused(pair):
    _, unfused, fused = pair
    for seed in range(3):  # prefill-like (no past) and decode-like (past in the cache) inputs
        inputs = example_inputs(fused, batch=3, tokens=5, context=16, past_max=11 * (seed > 0), seed=seed)
        expected, actual = unfused(**inputs), fused(**inputs)
        valid = torch.arange(5)[None, :] < inputs["input_lens"][:, None]
        torch.testing.assert_close(actual["logits"][valid], expected["logits"][valid], atol=1e-4, rtol=0)
        for name in expected:
            if name != "logits":
                torch.testing.assert_close(actual[name], expected[name], atol=1e-4, rtol=0)


def test_llama_family_matches_once_per_layer(pair):
    arch, _, fused = pair
    if arch not in LLAMA_FAMILY:
        pytest.skip("Llama-family counts")
    layers = fused.spec.num_layers
    projections = _stats(fused, "fuse_projections")
    assert (projections["qkv"], projections["pairs"], projections["silu_mul"]) == (layers, layers, layers)
    assert _stats(fused, "fuse_rope")["rope"] == 2 * layers  # q and k of each layer
    norms = _stats(fused, "fuse_norms")
    assert norms["add_rms_norm"] == 2 * layers  # before attention (but layer 0) and MLP, and the final norm
    qk_norms = 2 * layers if arch == "qwen3" else 0
    assert norms["rms_norm"] == 1 + qk_norms


def test_one_matmul_for_qkv_and_one_for_gate_up_per_layer(pair):
    arch, _, fused = pair
    if arch not in LLAMA_FAMILY:
        pytest.skip("Llama-family structure")
    spec = fused.spec
    graph = fused.graph_module
    widths = [fetch_attr(graph, n.args[1].target).shape[0] for n in graph.graph.nodes if n.target is LINEAR]
    qkv_width = (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim
    assert widths.count(qkv_width) == spec.num_layers
    assert widths.count(2 * spec.intermediate_size) == spec.num_layers
    assert len(widths) == 4 * spec.num_layers + 1  # qkv, o, gate_up, down per layer + LM head
    targets = [n.target for n in graph.graph.nodes]
    assert targets.count(SILU_MUL.overload) == spec.num_layers
    assert targets.count(ROPE.overload) == 2 * spec.num_layers


def test_gpt2_has_nothing_to_fuse_and_stays_unchanged(pair):
    arch, unfused, fused = pair
    if arch != "gpt2":
        pytest.skip("GPT-2 only")
    for name in FUSION:
        stats = _stats(fused, name)
        assert all(v == 0 for k, v in stats.items() if not k.startswith(("nodes", "param"))), (name, stats)
        assert stats["nodes"] == stats["nodes_before"]
