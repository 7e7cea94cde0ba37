"""ONNX lowering run by ONNX Runtime (CPU EP) against the torch reference: prefill + 8 decode steps, batch 3."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch

from llmlower.backends.onnx import LoweringError, to_onnx
from llmlower.backends.torch import TorchExecutor
from llmlower.cli import main
from llmlower.frontend import capture, load
from llmlower.passes import build_pipeline, run_pipeline
from llmlower.runtime import StepBatch
from llmlower.runtime.executors.onnx import OnnxExecutor

PROMPT_LENS = [5, 9, 3]
FULL_LOGITS = "canonicalize,fuse_norms,fuse_rope,fuse_projections,kv_cache,fuse_qkv_attention"


def _max_difference(program, accuracy_level: int = 4) -> float:
    """Largest logit difference between the ONNX and torch executors over a batched prefill + 8 decodes."""
    model = to_onnx(program, accuracy_level=accuracy_level).SerializeToString()
    ours, reference = OnnxExecutor(model, max_batch=3, max_context=32), TorchExecutor(program, 3, 32)
    gen = torch.Generator().manual_seed(0)
    vocab = program.spec.vocab_size
    batch = StepBatch([0, 1, 2], [torch.randint(5, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENS], [0] * 3)
    worst = float(np.abs(ours.step(batch) - reference.step(batch)).max())
    past = list(PROMPT_LENS)
    for _ in range(8):
        tokens = [[int(t)] for t in torch.randint(5, vocab, (3,), generator=gen)]
        batch = StepBatch([0, 1, 2], tokens, past)
        worst = max(worst, float(np.abs(ours.step(batch) - reference.step(batch)).max()))
        past = [p + 1 for p in past]
    return worst


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3", "gemma", "gpt2"])
def test_fp32_onnx_matches_the_torch_reference(arch, tiny_checkpoints):
    program = run_pipeline(capture(load(tiny_checkpoints[arch])), build_pipeline())
    assert _max_difference(program) <= 1e-4


@pytest.mark.parametrize("quant", ["q8", "q4g32", "q4g32-zp4", "q4g128-sym"])
def test_quantized_lowering_is_exact_in_float32(quant, tiny_checkpoints):
    """With MatMulNBits computing in float32 (accuracy_level 0) the int4 lowering, including float zero
    points split into a symmetric MatMulNBits plus a group-sum correction, computes the reference's product."""
    program = run_pipeline(capture(load(tiny_checkpoints["llama"])), build_pipeline(quant=quant))
    assert _max_difference(program, accuracy_level=0) <= 1e-4


def test_an_op_without_lowering_is_named(tiny_checkpoints):
    program = run_pipeline(capture(load(tiny_checkpoints["gpt2"])), build_pipeline(quant="q8", quantize_embedding=True))
    with pytest.raises(LoweringError, match=r"cannot lower node qembedding\w* \(op llmlower.qembedding"):
        to_onnx(program)


def test_cuda_target_is_a_float16_graph_that_onnxruntime_runs(tiny_llama, tmp_path):
    """`--target cuda` builds float16 (what the CUDA EP runs fastest); the same graph runs on the CPU EP here
    and stays within float16 rounding of the float32 reference."""
    out = tmp_path / "cuda"
    assert main(["compile", str(tiny_llama), "-o", str(out), "--target", "cuda", "--passes", FULL_LOGITS]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["dtype"] == "float16" and manifest["providers"][0] == "CUDAExecutionProvider"
    model = onnx.load(out / "model.onnx")
    assert model.graph.output[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT16
    assert {"GroupQueryAttention", "SkipSimplifiedLayerNormalization"} <= {n.op_type for n in model.graph.node}

    ours = OnnxExecutor(str(out / "model.onnx"), max_batch=3, max_context=32)  # CPU EP
    program = run_pipeline(capture(load(tiny_llama)), build_pipeline(FULL_LOGITS.split(",")))
    reference = TorchExecutor(program, 3, 32)
    batch = StepBatch([0, 1, 2], [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]], [0] * 3)
    expected = reference.step(batch)
    assert np.abs(ours.step(batch) - expected).max() <= 1e-2 * np.abs(expected).max()
    batch = StepBatch([0, 1, 2], [[3], [4], [5]], [5, 2, 3])
    expected = reference.step(batch)
    assert np.abs(ours.step(batch) - expected).max() <= 1e-2 * np.abs(expected).max()


def test_slots_out_of_order_and_non_contiguous(tiny_llama):
    """Sequences in slots 2 and 0 (bound as two runs of cache rows) give the logits they give in slots 0, 1."""
    program = run_pipeline(capture(load(tiny_llama)), build_pipeline())
    model = to_onnx(program).SerializeToString()
    ours, reference = OnnxExecutor(model, max_batch=3, max_context=32), TorchExecutor(program, 3, 32)
    prompts, past = [[5, 6, 7, 8], [9, 10]], [4, 2]
    expected = reference.step(StepBatch([0, 1], prompts, [0, 0]))
    np.testing.assert_allclose(ours.step(StepBatch([2, 0], prompts, [0, 0])), expected, atol=1e-4)
    for token in (11, 12, 13):
        expected = reference.step(StepBatch([0, 1], [[token], [token]], past))
        np.testing.assert_allclose(ours.step(StepBatch([2, 0], [[token], [token]], past)), expected, atol=1e-4)
        past = [p + 1 for p in past]


def test_a_prompt_continued_in_chunks_and_mixed_steps(tiny_llama):
    """A sequence extended by several tokens at once (chunked prefill, multi-turn chat), alone and in a step
    with another sequence decoding one token, matches the reference."""
    program = run_pipeline(capture(load(tiny_llama)), build_pipeline())
    model = to_onnx(program).SerializeToString()
    ours, reference = OnnxExecutor(model, max_batch=2, max_context=32), TorchExecutor(program, 2, 32)
    steps = [
        StepBatch([0, 1], [[5, 6, 7, 8, 9], [10, 11]], [0, 0]),
        StepBatch([0], [[12, 13, 14]], [5]),
        StepBatch([0, 1], [[15, 16], [17]], [8, 2]),
    ]
    for batch in steps:
        np.testing.assert_allclose(ours.step(batch), reference.step(batch), atol=1e-4)
