"""ONNX lowering run by ONNX Runtime (CPU EP) against the torch reference: prefill + 8 decode steps, batch 3."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

from llmlower.backends.onnx.export import LoweringError, to_onnx
from llmlower.backends.torch.program_executor import TorchExecutor
from llmlower.ir import ADD_RMS_NORM
from llmlower.passes import build_pipeline, run_pipeline
from llmlower.runtime import StepBatch
from llmlower.runtime.executors.onnx import OnnxSlotExecutor
from llmlower.testing import calibrated

PROMPT_LENS = [5, 9, 3]
FULL_LOGITS = "canonicalize,fuse_norms,fuse_rope,fuse_projections,kv_cache,fuse_qkv_attention"


def _executors(program, accuracy_level: int = 4, slots: int = 3):
    """The ONNX executor and the torch reference on the same slot program, 32 positions per slot."""
    model = to_onnx(program, accuracy_level=accuracy_level).SerializeToString()
    blocks = slots * 32 // 16
    return OnnxSlotExecutor(model, max_context=32, num_blocks=blocks), TorchExecutor(program, 32, blocks, 16)


def _batch(slots: list[int], tokens: list[list[int]], past: list[int]) -> StepBatch:
    """A step of sequences in the given slots (32 positions, blocks of 16: slot s is blocks 2s and 2s + 1)."""
    tables = [
        [2 * slot + i for i in range(-(-(p + len(t)) // 16))] for slot, t, p in zip(slots, tokens, past, strict=True)
    ]
    return StepBatch(tokens, past, tables)


def _max_difference(program, accuracy_level: int = 4) -> float:
    """Largest logit difference between the ONNX and torch executors over a batched prefill + 8 decodes."""
    ours, reference = _executors(program, accuracy_level)
    gen = torch.Generator().manual_seed(0)
    vocab = program.spec.vocab_size
    batch = _batch([0, 1, 2], [torch.randint(5, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENS], [0] * 3)
    worst = float(np.abs(ours.step(batch) - reference.step(batch)).max())
    past = list(PROMPT_LENS)
    for _ in range(8):
        tokens = [[int(t)] for t in torch.randint(5, vocab, (3,), generator=gen)]
        batch = _batch([0, 1, 2], tokens, past)
        worst = max(worst, float(np.abs(ours.step(batch) - reference.step(batch)).max()))
        past = [p + 1 for p in past]
    return worst


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gpt2"])
def test_fp32_onnx_matches_the_torch_reference(arch, captures):
    program = run_pipeline(captures(arch), build_pipeline())
    assert _max_difference(program) <= 1e-4


@pytest.mark.parametrize("quant", ["q8", "q8c", "q4g32", "q4g32-zp4", "q4g128-sym", "q4mix"])
def test_quantized_lowering_is_exact_in_float32(quant, captures):
    """With MatMulNBits computing in float32 (accuracy_level 0) the int4 lowering, including float zero
    points split into a symmetric MatMulNBits plus a group-sum correction, computes the reference's product."""
    program = run_pipeline(captures("llama"), calibrated(build_pipeline(quant=quant)))
    assert _max_difference(program, accuracy_level=0) <= 1e-4


@pytest.mark.parametrize("quant", ["q8", "q8c", "q4g32", "q4g32-zp4", "q4mix"])
@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_quantized_experts_are_exact_in_float32(arch, quant, captures):
    """Quantized experts at accuracy_level 0: QMoE computes 4-bit packed zero points in float32; q8 and q4mix
    (QMoE has only int8 activations at 8 bits, and runs mixed bits as 8) and float zero points (q4g32) run the
    float MoE over the dequantized experts. Either way the reference's logits."""
    program = run_pipeline(captures(arch), calibrated(build_pipeline(quant=quant)))
    assert program.history[-1].stats["experts_quantized"] == 2
    kernels = [n.op_type for n in to_onnx(program, accuracy_level=0).graph.node if n.op_type in ("MoE", "QMoE")]
    assert kernels == ["QMoE" if quant == "q4g32-zp4" else "MoE"] * 2
    assert _max_difference(program, accuracy_level=0) <= 1e-4


@pytest.mark.parametrize(("arch", "quant"), [("llama", "q4mix"), ("llama", "q4g32"), ("mixtral", "q4g32-zp4")])
def test_float16_scales_are_widened_for_onnx_runtime(arch, quant, captures):
    """Scales and float zero points kept in float16 (--scale-dtype float16): MatMulNBits and QMoE take them in the
    activations' type, so the export widens them (no float16 tensor left in the model) and the logits are the
    reference's, which computes with the same float16 values."""
    program = run_pipeline(captures(arch), calibrated(build_pipeline(quant=quant, scale_dtype="float16")))
    model = to_onnx(program, accuracy_level=0)
    kernels = {n.op_type for n in model.graph.node} & {"MatMulNBits", "QMoE"}
    assert kernels == ({"MatMulNBits", "QMoE"} if arch == "mixtral" else {"MatMulNBits"})
    assert onnx.TensorProto.FLOAT16 not in {tensor.data_type for tensor in model.graph.initializer}
    assert _max_difference(program, accuracy_level=0) <= 1e-4


def test_per_channel_int8_multiplies_in_integers_row_by_row(captures):
    """q8c at accuracy_level 4: every linear is an integer GEMM (MatMulIntegerToFloat, no MatMulNBits) within the
    int8-activation tolerance of the reference, and activations are quantized per row: a sequence's logits are the
    same alone as beside another whose activations span a different range."""
    program = run_pipeline(captures("llama"), calibrated(build_pipeline(quant="q8c")))
    kernels = {node.op_type for node in to_onnx(program).graph.node}
    assert "MatMulIntegerToFloat" in kernels and "MatMulNBits" not in kernels
    ours, reference = _executors(program)
    prompts = [[5, 6, 7, 8], [90, 91, 92, 93, 94, 95, 96]]
    together = ours.step(_batch([0, 1], prompts, [0, 0]))
    expected = reference.step(_batch([0, 1], prompts, [0, 0]))
    assert np.abs(together - expected).max() <= 0.1 * max(1.0, float(np.abs(expected).max()))
    np.testing.assert_allclose(ours.step(_batch([2], prompts[:1], [0])), together[:1], rtol=0, atol=1e-5)


def test_an_op_without_lowering_is_named(captures):
    program = run_pipeline(captures("gpt2"), build_pipeline(quant="q8", quantize_embedding=True))
    with pytest.raises(LoweringError, match=r"cannot lower node qembedding\w* \(op llmlower.qembedding"):
        to_onnx(program)


def test_slots_out_of_order_with_a_gap(captures):
    """Sequences in slots 2 and 0 (one run over rows 0..2, row 1 holding another sequence that must survive)
    give the logits they give in slots 0 and 1."""
    program = run_pipeline(captures("llama"), build_pipeline())
    ours, reference = _executors(program)
    bystander = _batch([1], [[20, 21, 22]], [0])
    expected_bystander = ours.step(bystander)
    prompts, past = [[5, 6, 7, 8], [9, 10]], [4, 2]
    expected = reference.step(_batch([0, 1], prompts, [0, 0]))
    np.testing.assert_allclose(ours.step(_batch([2, 0], prompts, [0, 0])), expected, atol=1e-4)
    for token in (11, 12, 13):
        expected = reference.step(_batch([0, 1], [[token], [token]], past))
        np.testing.assert_allclose(ours.step(_batch([2, 0], [[token], [token]], past)), expected, atol=1e-4)
        past = [p + 1 for p in past]
    reference.step(bystander)  # the sequence in slot 1 goes on as if nothing had run beside it
    np.testing.assert_allclose(ours.step(_batch([1], [[23]], [3])), reference.step(_batch([1], [[23]], [3])), atol=1e-4)
    assert expected_bystander.shape == (1, program.spec.vocab_size)


def test_a_prompt_continued_in_chunks_and_mixed_steps(captures):
    """A sequence extended by several tokens at once (chunked prefill, multi-turn chat), alone and in a step
    with another sequence decoding one token, matches the reference; block copies move a prefix."""
    program = run_pipeline(captures("llama"), build_pipeline())
    ours, reference = _executors(program)
    steps = [
        _batch([0, 1], [[5, 6, 7, 8, 9], [10, 11]], [0, 0]),
        _batch([0], [[12, 13, 14]], [5]),
        _batch([0, 1], [[15, 16], [17]], [8, 2]),
        _batch([0, 1, 2], [list(range(20, 30)), [18], [30, 31]], [10, 3, 0]),
    ]
    for batch in steps:
        np.testing.assert_allclose(ours.step(batch), reference.step(batch), atol=1e-4)
    for executor in (ours, reference):
        executor.copy_blocks([(0, 4)])  # slot 0's first 16 positions into slot 2
    continued = _batch([2], [[40, 41]], [16])
    np.testing.assert_allclose(ours.step(continued), reference.step(continued), atol=1e-4)


class _AddRmsNorm(torch.nn.Module):
    def forward(self, x, residual, weight):
        return ADD_RMS_NORM.op(x, residual, weight, 1e-6)


@pytest.mark.parametrize("shape", [(2, 5, 16), (2, 3, 5, 16)], ids=["rows", "heads"])
def test_add_rms_norm_lowers_any_rank(shape, onnx_session):
    """ONNX Runtime's SkipSimplifiedLayerNormalization takes 2-D or 3-D inputs; a per-head norm of a sum (HunYuan's
    q/k norm after rotary) is 4-D and runs as rows."""
    gen = torch.Generator().manual_seed(0)
    inputs = (torch.randn(shape, generator=gen), torch.randn(shape, generator=gen), torch.randn(16, generator=gen))
    session, _ = onnx_session(_AddRmsNorm(), inputs)
    got = session.run(None, {i.name: t.numpy() for i, t in zip(session.get_inputs(), inputs, strict=True)})
    for ours, expected in zip(got, _AddRmsNorm()(*inputs), strict=True):
        np.testing.assert_allclose(ours, expected.numpy(), atol=1e-5, rtol=1e-5)
