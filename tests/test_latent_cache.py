"""The latent_cache pass and the latent_attention ops: DeepSeek's multi-head latent attention cached as DeepSeek
caches it (per token the latent and the shared rotary key) computes what attention over the expanded keys and
values computes, the pass finds every MLA layer of the captured graph (and nothing in other models), and the
ONNX, TVM and MLIR artifacts generate transformers' own greedy tokens from the smaller cache."""

from __future__ import annotations

import json

import pytest
import torch

from llmlower.api import compile_artifact
from llmlower.ir import LATENT_ATTENTION
from llmlower.ir.attention import attention_reference
from llmlower.ir.latent_attention import latent_attention_reference, paged_latent_attention
from llmlower.ir.paged_attention import paged_attention
from llmlower.passes import run_pipeline
from llmlower.roofline import decode_step, step_cost
from llmlower.runtime import Engine, SamplingParams

HEADS, RANK, ROPE, NOPE, DV = 4, 16, 8, 12, 10
PIPELINE = ["canonicalize", "fuse_norms", "fuse_rope", "fuse_projections", "kv_cache", "latent_cache"]
PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):",
    "Compilers lower graphs to kernels; caches hold keys and values.",
    "12345",
    "The lazy dog and the quick brown fox jump over the compilers and their kernels.",
    "東京",
]


def _expanded(latent: torch.Tensor, k_pe: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys [.., heads, n, nope + rope] and values [.., heads, n, dv] as DeepSeek's modeling code makes them."""
    per_head = torch.matmul(latent, weight.T).unflatten(-1, (HEADS, NOPE + DV)).movedim(-2, -3).squeeze(-4)
    keys = torch.cat((per_head[..., :NOPE], k_pe.expand(*per_head.shape[:-1], ROPE)), dim=-1)
    return keys, per_head[..., NOPE:]


def _step(batch: int, tokens: int, context: int):
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(batch, HEADS, tokens, NOPE + ROPE, generator=generator)
    latent, k_pe = torch.randn(batch, 1, tokens, RANK, generator=generator), torch.randn(batch, 1, tokens, ROPE)
    weight = torch.randn(HEADS * (NOPE + DV), RANK, generator=generator) / 4
    c_cache, pe_cache = torch.randn(batch, 1, context, RANK), torch.randn(batch, 1, context, ROPE)
    return q, latent, k_pe, weight, c_cache, pe_cache


def test_the_slot_op_is_attention_over_the_expanded_keys_and_values():
    q, latent, k_pe, weight, c_cache, pe_cache = _step(batch=3, tokens=4, context=12)
    past, lens = torch.tensor([5, 0, 8]), torch.tensor([4, 3, 1])
    out, c_new, pe_new = latent_attention_reference(q, latent, k_pe, weight, c_cache, pe_cache, past, lens, 0.3)
    k, v = _expanded(latent, k_pe, weight)
    k_cache, v_cache = _expanded(c_cache, pe_cache, weight)
    expected, k_written, v_written = attention_reference(q, k, v, k_cache, v_cache, past, lens, 0.3)
    for row, n in enumerate(lens.tolist()):
        torch.testing.assert_close(out[row, :, :n], expected[row, :, :n], rtol=1e-5, atol=1e-5)
    written_k, written_v = _expanded(c_new, pe_new, weight)
    torch.testing.assert_close(written_k, k_written, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(written_v, v_written, rtol=1e-5, atol=1e-5)


def test_the_paged_op_is_paged_attention_over_the_expanded_keys_and_values():
    q, latent, k_pe, weight, c_pool, pe_pool = _step(batch=1, tokens=5, context=6 * 4)
    c_pool, pe_pool = c_pool.reshape(6, 4, 1, RANK), pe_pool.reshape(6, 4, 1, ROPE)
    tables, past, lens = torch.tensor([[4, 0, 2], [5, 1, 3]]), torch.tensor([6, 1]), torch.tensor([3, 2])
    out, c_new, pe_new = paged_latent_attention(q, latent, k_pe, weight, c_pool, pe_pool, tables, past, lens, 0.3)
    k, v = _expanded(latent, k_pe, weight)
    k_pool, v_pool = (x.transpose(1, 2) for x in _expanded(c_pool.transpose(1, 2), pe_pool.transpose(1, 2), weight))
    expected, k_written, _ = paged_attention(q, k, v, k_pool, v_pool, tables, past, lens, 0.3)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    rewritten_k = _expanded(c_new.transpose(1, 2), pe_new.transpose(1, 2), weight)[0].transpose(1, 2)
    torch.testing.assert_close(rewritten_k, k_written, rtol=1e-5, atol=1e-5)


def test_the_cost_reads_the_latent_cache_once_per_token():
    cost = LATENT_ATTENTION.cost(
        batch=2,
        tokens=1,
        heads=HEADS,
        rank=RANK,
        rope_dim=ROPE,
        nope_dim=NOPE,
        value_head_dim=DV,
        context=100,
        element_bytes=2,
    )
    assert cost.kv_read_bytes == 2 * 100 * (RANK + ROPE) * 2
    assert cost.kv_write_bytes == 2 * 1 * (RANK + ROPE) * 2
    assert cost.weight_bytes == HEADS * (NOPE + DV) * RANK * 2


def test_the_pass_caches_the_latent_of_every_mla_layer(captures):
    program = run_pipeline(captures("deepseek_v3"), PIPELINE, verify=True)
    record = program.history[-1]
    assert record.stats["matches"] == 2 and record.max_error < 1e-5
    shapes = {t.name: t.shape for t in program.inputs}
    assert shapes["k_cache_0"] == ("batch", 1, "context", 16) and shapes["v_cache_0"] == ("batch", 1, "context", 8)
    assert record.stats["kv_bytes_per_token_before"] == 2 * 4 * (24 + 16) * 4  # 4 heads, keys 16 + 8, values 16
    assert program.spec.kv_bytes_per_token() == record.stats["kv_bytes_per_token"] == 2 * (16 + 8) * 4
    targets = {n.target for n in program.graph_module.graph.nodes if n.op == "call_function"}
    assert torch.ops.llmlower.attention.default not in targets
    step = step_cost(program, decode_step(batch=1, context=40)).total  # the roofline reads the latent cache
    assert step.kv_read_bytes == program.spec.kv_cache_bytes(40)
    assert step.kv_write_bytes == program.spec.kv_cache_bytes(1)
    linears = [n for n in program.graph_module.graph.nodes if n.target is torch.ops.aten.linear.default]
    assert not [n for n in linears if "kv_b_proj" in str(n.args[1].target)]  # the expansion is gone


def test_models_without_latent_attention_are_left_alone(captures):
    program = run_pipeline(captures("llama"), PIPELINE)
    assert program.history[-1].stats["matches"] == 0
    assert all(t.shape[1] == 2 for t in program.inputs if t.name.startswith(("k_cache", "v_cache")))


@pytest.mark.parametrize("backend", ["onnx", "tvm", "mlir"])
def test_latent_artifacts_generate_transformers_tokens(backend, tiny_checkpoints, greedy_reference, tmp_path):
    checkpoint = tiny_checkpoints["deepseek_v3"]
    artifact = compile_artifact(checkpoint, tmp_path / "artifact", [*PIPELINE, "last_token_logits"], backend=backend)
    spec = json.loads((artifact / "manifest.json").read_text())["spec"]
    assert spec["kv_widths"] == [16 + 8, 16 + 8]
    engine = Engine.load(artifact, max_num_seqs=6, max_context=128, max_num_batched_tokens=24)
    results = engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), chat=False)
    assert max(len(r.prompt_token_ids) for r in results) > 24  # prompt chunks beside decodes
    for result in results:
        assert result.token_ids == greedy_reference(checkpoint, result.prompt_token_ids, 8), result.prompt_token_ids
