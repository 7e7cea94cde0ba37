"""The ONNX backend's CUDA target: PAGED programs lowered to ONNX Runtime's com.microsoft.PagedAttention.

PagedAttention has no CPU kernel, so on a machine without a GPU the exported graph's wiring (packing, int32
sequence metadata, rotary tables, pools in and out) is checked numerically with onnx's ReferenceEvaluator,
given Python implementations of the contrib ops the graph uses, written from their documented semantics,
against the torch reference on the same float16 program. The executor's pool machinery (zeroed pools,
on-device block copies through a helper session) runs here on the CPU EP; the CUDA executor's steps run
only where onnxruntime can start the CUDA EP (the last test).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx.reference import ReferenceEvaluator
from onnx.reference.op_run import OpRun

from llmlower.api import compile_program
from llmlower.backends.onnx.export import LoweringError, to_onnx
from llmlower.backends.onnx.lowerings import translations
from llmlower.backends.torch.program_executor import TorchExecutor
from llmlower.errors import GenerationError
from llmlower.ir import PAGED_ATTENTION
from llmlower.passes import DEFAULT_PIPELINE
from llmlower.runtime import Engine, StepBatch
from llmlower.runtime.artifact import read_manifest
from llmlower.runtime.executor import copy_rounds, pack_batch, step_arrays, step_logits
from llmlower.runtime.executors import onnx_paged
from llmlower.runtime.executors.onnx_paged import OnnxPagedExecutor
from llmlower.step_io import BLOCK_TABLES, KVLayout, pool_names

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 2, 4, 2, 16, 16  # tests/conftest.py's tiny Llama
POOL_BLOCKS = 12
# one step of three packed sequences: a decode, a chunk after a prefix block it shares with the decode
# (block 7), and a chunk crossing into a new block; the blocks scattered through the pool
STEP = StepBatch(
    tokens=[[11], [12, 13, 14, 15], [16, 17, 18, 19, 20]], past_lens=[30, 16, 13], block_tables=[[7, 2], [7, 5], [9, 3]]
)


@pytest.fixture(scope="module")
def artifact(tiny_llama, compiled) -> Path:
    return compiled(tiny_llama, target="cuda")


@pytest.fixture(scope="module")
def model(artifact) -> onnx.ModelProto:
    return onnx.load(str(artifact / "model.onnx"))


@pytest.fixture(scope="module")
def reference_program(tiny_llama):
    """The same float16 PAGED program, for the torch reference."""
    return compile_program(tiny_llama, DEFAULT_PIPELINE, dtype="float16", kv_layout=KVLayout.PAGED)[1]


# ---------------------------------------------------------------- the artifact and its graph


def test_manifest_describes_a_paged_float16_cuda_artifact(artifact):
    manifest = read_manifest(artifact)
    assert manifest["dtype"] == "float16"
    assert manifest["target"] == "cuda"
    assert manifest["providers"][0] == "CUDAExecutionProvider"
    assert manifest["kv_layout"] == {
        "kind": "paged",
        "shape": ["num_blocks", "block_size", "kv_heads", "head_dim"],
        "layers": LAYERS,
        "kv_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "dtype": "float16",
        "block_size": BLOCK,
    }


def _dims(value: onnx.ValueInfoProto) -> list:
    return [d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim]


def test_graph_has_one_paged_attention_per_layer_on_the_pools(model):
    onnx.checker.check_model(model)
    nodes = [n for n in model.graph.node if n.op_type == "PagedAttention"]
    assert len(nodes) == LAYERS
    assert not any(n.op_type == "GroupQueryAttention" for n in model.graph.node)
    inputs = {i.name: i for i in model.graph.input}
    outputs = {o.name for o in model.graph.output}
    assert inputs[BLOCK_TABLES].type.tensor_type.elem_type == onnx.TensorProto.INT64
    for layer, node in enumerate(nodes):
        assert node.domain == "com.microsoft"
        attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert attributes["num_heads"] == HEADS and attributes["kv_num_heads"] == KV_HEADS
        assert attributes["do_rotary"] == 1
        assert attributes["scale"] == pytest.approx(HEAD_DIM**-0.5)
        k_pool, v_pool = pool_names(layer)
        assert list(node.input[3:5]) == [k_pool, v_pool]  # the pools straight from the graph inputs
        assert list(node.output[1:]) == [f"present_{k_pool}", f"present_{v_pool}"]  # straight to the outputs
        assert node.input[1] == node.input[2] == ""  # packed qkv
        for name in (k_pool, v_pool):
            assert inputs[name].type.tensor_type.elem_type == onnx.TensorProto.FLOAT16
            assert _dims(inputs[name])[1:] == [BLOCK, KV_HEADS, HEAD_DIM]
            assert isinstance(_dims(inputs[name])[0], str)  # the pool's size is the runtime's choice
            assert f"present_{name}" in outputs


def test_a_float32_paged_program_is_refused_by_name(tiny_llama):
    _, program = compile_program(tiny_llama, DEFAULT_PIPELINE, dtype="float32", kv_layout=KVLayout.PAGED)
    with pytest.raises(LoweringError, match=r"node paged_qkv_attention\w* .* in float32: .*runs float16"):
        to_onnx(program)


def test_a_paged_recurrent_state_is_refused_by_name_with_the_layouts_that_run_it(tiny_checkpoints):
    """A hybrid model in the paged layout (what --target cuda compiles): refused naming the recurrent op, pointing
    at the CPU target and TVM, before anything is exported."""
    _, program = compile_program(tiny_checkpoints["lfm2"], DEFAULT_PIPELINE, dtype="float16", kv_layout=KVLayout.PAGED)
    with pytest.raises(LoweringError, match=r"node paged_causal_conv1d\w* .*--target cpu.*--backend tvm"):
        to_onnx(program)


# ---------------------------------------------------------------- the graph's numbers, on the CPU


class PagedAttention(OpRun):
    """com.microsoft.PagedAttention as its schema documents it: the step's tokens packed (cumulative
    sequence lengths), token t of sequence b at position past_seqlens[b] + t, its k/v written into
    block block_table[b, position // block_size] at offset position % block_size, then causal attention
    over the sequence's positions, grouped kv heads, float32 softmax; softcap caps the scaled logits at
    softcap * tanh(logit / softcap), head_sink adds each head's sink logit to the softmax denominator only."""

    op_domain = "com.microsoft"

    def _run(
        self, query, key, value, key_cache, value_cache, cumulative, past, block_table, cos=None, sin=None,
        slot_mapping=None, head_sink=None, **a,
    ):  # fmt: skip
        heads, kv_heads = a["num_heads"], a["kv_num_heads"]
        window, softcap = a.get("local_window_size", -1), a.get("softcap", 0.0)
        assert not a.get("rotary_interleaved", 0) and slot_mapping is None
        assert cumulative.dtype == past.dtype == block_table.dtype == np.int32
        tokens = query.shape[0]
        if key is None:  # packed qkv
            head_dim = query.shape[1] // (heads + 2 * kv_heads)
            query, key, value = np.split(query, [heads * head_dim, (heads + kv_heads) * head_dim], axis=1)
        head_dim = query.shape[1] // heads
        scale = a.get("scale") or head_dim**-0.5
        q = query.reshape(tokens, heads, head_dim).astype(np.float32)
        k = key.reshape(tokens, kv_heads, head_dim).astype(np.float32)
        v = value.reshape(tokens, kv_heads, head_dim)
        assert cumulative[0] == 0 and cumulative[-1] == tokens
        key_cache, value_cache = key_cache.copy(), value_cache.copy()
        block_size = key_cache.shape[1]
        out = np.zeros((tokens, heads, head_dim), np.float32)
        for b in range(len(past)):
            start, end = int(cumulative[b]), int(cumulative[b + 1])
            positions = int(past[b]) + np.arange(end - start)
            qb, kb = q[start:end], k[start:end]
            if a.get("do_rotary", 0):
                qb, kb = (_rotate(x, cos[positions], sin[positions]) for x in (qb, kb))
            blocks, offsets = block_table[b, positions // block_size], positions % block_size
            key_cache[blocks, offsets] = kb.astype(key_cache.dtype)
            value_cache[blocks, offsets] = v[start:end]
            keys = np.arange(positions[-1] + 1)
            where = block_table[b, keys // block_size], keys % block_size
            k_seq, v_seq = key_cache[where].astype(np.float32), value_cache[where].astype(np.float32)
            group = heads // kv_heads
            k_seq, v_seq = np.repeat(k_seq, group, axis=1), np.repeat(v_seq, group, axis=1)  # [keys, heads, D]
            scores = np.einsum("thd,khd->htk", qb, k_seq) * scale
            if softcap:
                scores = softcap * np.tanh(scores / softcap)
            allowed = keys[None, :] <= positions[:, None]
            if window > 0:
                allowed &= keys[None, :] > positions[:, None] - window
            scores = np.where(allowed[None], scores, -np.inf)
            top = scores.max(axis=-1, keepdims=True)
            weights = np.exp(scores - top)
            sink = 0.0 if head_sink is None else np.exp(head_sink.astype(np.float32)[:, None, None] - top)
            weights /= weights.sum(axis=-1, keepdims=True) + sink
            out[start:end] = np.einsum("htk,khd->thd", weights, v_seq)
        return out.reshape(tokens, heads * head_dim).astype(query.dtype), key_cache, value_cache


def _rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Non-interleaved rotary on the first 2 * cos.shape[1] channels of each head (x: [tokens, heads, D])."""
    half = cos.shape[1]
    cos, sin = cos[:, None].astype(np.float32), sin[:, None].astype(np.float32)
    first, second = x[..., :half], x[..., half : 2 * half]
    rotated = np.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
    return np.concatenate([rotated, x[..., 2 * half :]], axis=-1)


def _rms_normalize(x: np.ndarray, gamma: np.ndarray, epsilon: float) -> np.ndarray:
    """ONNX Runtime's (Skip)SimplifiedLayerNormalization: float32 statistics over the last axis."""
    x32 = x.astype(np.float32)
    inverse = 1.0 / np.sqrt(np.mean(x32 * x32, axis=-1, keepdims=True) + epsilon)
    return (x32 * inverse * gamma.astype(np.float32)).astype(x.dtype)


class SimplifiedLayerNormalization(OpRun):
    op_domain = ""

    def _run(self, x, scale, axis=-1, epsilon=1e-5, stash_type=1):
        assert axis in (-1, x.ndim - 1)
        return (_rms_normalize(x, scale, epsilon),)


class SkipSimplifiedLayerNormalization(OpRun):
    """Outputs (normalized, mean, inv_std_var, input + skip + bias); the graph uses the first and last."""

    op_domain = "com.microsoft"

    def _run(self, x, skip, gamma, bias=None, epsilon=1e-5):
        total = x + skip if bias is None else x + skip + bias
        unused = np.zeros(total.shape[:-1] + (1,), np.float32)
        return _rms_normalize(total, gamma, epsilon), unused, unused, total


CONTRIB_OPS = [PagedAttention, SimplifiedLayerNormalization, SkipSimplifiedLayerNormalization]


def test_contrib_ops_of_the_graph_all_have_reference_implementations(model):
    """Every node outside the standard opset is one the reference check below implements."""
    custom = {(n.domain, n.op_type) for n in model.graph.node if n.domain not in ("", "ai.onnx")}
    custom |= {("", n.op_type) for n in model.graph.node if n.op_type == "SimplifiedLayerNormalization"}
    assert custom == {(op.op_domain, op.__name__) for op in CONTRIB_OPS}


def test_graph_computes_the_torch_reference_step(model, reference_program):
    """A packed step of three sequences (a decode, a chunk after a shared prefix block, a chunk crossing a
    block boundary; blocks scattered through the pool) through the exported graph, evaluated on the CPU
    with the contrib ops above, gives the torch reference's last-token logits and updated pools."""
    reference = TorchExecutor(reference_program, max_context=64, num_blocks=POOL_BLOCKS)
    generator = np.random.default_rng(0)
    pools = {}
    for layer in range(LAYERS):
        for name in pool_names(layer):
            pools[name] = generator.standard_normal((POOL_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM)).astype(np.float16)
            reference.caches[name] = torch.from_numpy(pools[name].copy())
    expected = reference.step(STEP)

    packed = pack_batch(STEP)
    feeds = {**step_arrays(packed), **pools}
    evaluator = ReferenceEvaluator(model, new_ops=CONTRIB_OPS)
    names = [o.name for o in model.graph.output]
    outputs = dict(zip(names, evaluator.run(None, {i.name: feeds[i.name] for i in model.graph.input}), strict=True))

    logits = step_logits(outputs["logits"], packed.logits_indices, all_positions=False)
    assert logits.shape == expected.shape == (3, reference_program.spec.vocab_size)
    np.testing.assert_allclose(logits, expected, atol=2e-2, rtol=0)
    assert (logits.argmax(-1) == expected.argmax(-1)).all()

    written = np.zeros((POOL_BLOCKS, BLOCK), dtype=bool)  # the positions the step writes
    for past, tokens, table in zip(STEP.past_lens, STEP.tokens, STEP.block_tables, strict=True):
        positions = past + np.arange(len(tokens))
        written[np.asarray(table)[positions // BLOCK], positions % BLOCK] = True
    for name, before in pools.items():
        ours, theirs = outputs[f"present_{name}"], reference.caches[name].numpy()
        assert ours.dtype == np.float16
        np.testing.assert_array_equal(ours[~written], before[~written])  # nothing else moved
        np.testing.assert_array_equal(theirs[~written], before[~written])
        np.testing.assert_allclose(ours[written].astype(np.float32), theirs[written], atol=1e-2, rtol=0)
        assert not np.allclose(ours[written], before[written])  # the step's keys and values did land


# ---------------------------------------------------------------- the executor


def _cuda_runs(artifact: Path) -> bool:
    try:
        OnnxPagedExecutor.from_artifact(artifact, read_manifest(artifact), 8, BLOCK, 64, 0)
    except GenerationError:
        return False
    return True


def test_without_a_usable_cuda_ep_loading_says_so(artifact):
    """Here onnxruntime-gpu lists the CUDA EP but cannot start it (no GPU) and would fall back to the CPU,
    which has no PagedAttention kernel: the executor and Engine.load name the problem instead."""
    if _cuda_runs(artifact):
        pytest.skip("onnxruntime starts the CUDA EP here (see test_cuda_executor_matches_the_torch_reference)")
    manifest = read_manifest(artifact)
    message = r"needs the CUDA execution provider; onnxruntime here offers .*CPUExecutionProvider"
    with pytest.raises(GenerationError, match=message):
        OnnxPagedExecutor.from_artifact(artifact, manifest, 8, BLOCK, 64, 0)
    with pytest.raises(GenerationError, match=message):
        Engine.load(artifact, max_num_seqs=2, max_context=64)
    with pytest.raises(GenerationError, match="offers CPUExecutionProvider .install onnxruntime-gpu"):
        raise onnx_paged.cuda_unavailable(["CPUExecutionProvider"])


def test_block_copies_run_in_place_through_the_artifacts_copy_model(artifact):
    """copy_blocks.onnx on the CPU EP, each pool bound as its input and its output: the pools stay where they
    are and end as copying the pairs one by one would leave them."""
    manifest = read_manifest(artifact)
    assert manifest["entry_points"]["copy_blocks"] == {"file": "copy_blocks.onnx"}
    onnx.checker.check_model(onnx.load(str(artifact / "copy_blocks.onnx")), full_check=True)
    generator = np.random.default_rng(1)
    expected = {
        name: generator.standard_normal((6, BLOCK, KV_HEADS, HEAD_DIM)).astype(np.float16)
        for layer in range(LAYERS)
        for name in pool_names(layer)
    }
    pools = {name: ort.OrtValue.ortvalue_from_numpy(values.copy()) for name, values in expected.items()}
    addresses = {name: value.data_ptr() for name, value in pools.items()}
    session = onnx_paged.copy_session(str(artifact / "copy_blocks.onnx"), "CPUExecutionProvider")
    copier = onnx_paged.BlockCopier(session, pools)
    pairs = [(0, 3), (3, 5), (1, 1), (2, 4), (4, 0)]
    copier.copy(pairs)
    for name, value in pools.items():
        for source, destination in pairs:
            expected[name][destination] = expected[name][source]
        np.testing.assert_array_equal(value.numpy(), expected[name])
        assert value.data_ptr() == addresses[name]
    with pytest.raises(GenerationError, match="block 6 is outside the pool of 6"):
        copier.copy([(6, 0)])


def test_copy_rounds_keep_the_order_of_the_copies():
    assert copy_rounds([(1, 2), (3, 4)]) == [([1, 3], [2, 4])]
    assert copy_rounds([(1, 2), (2, 5), (3, 6)]) == [([1], [2]), ([2, 3], [5, 6])]
    assert copy_rounds([(1, 2), (3, 2)]) == [([1], [2]), ([3], [2])]
    assert copy_rounds([(1, 2), (3, 1)]) == [([1], [2]), ([3], [1])]  # block 1 is read before it is written


def test_cuda_executor_matches_the_torch_reference(artifact, reference_program):
    """Where a GPU is: prompts, a step sharing a prefix block, a copy-on-write block copy and a step reading
    the copy, on the CUDA executor and the torch reference from the same zeroed pools."""
    if not _cuda_runs(artifact):
        pytest.skip("onnxruntime cannot start the CUDA EP here")
    ours = OnnxPagedExecutor.from_artifact(artifact, read_manifest(artifact), POOL_BLOCKS, BLOCK, 64, 0)
    theirs = TorchExecutor(reference_program, max_context=64, num_blocks=POOL_BLOCKS)
    prompt = list(range(40, 70))
    steps = [
        StepBatch([prompt, list(range(80, 93))], [0, 0], [[7, 2], [9]]),
        StepBatch([[11], prompt[16:20], [16, 17, 18, 19, 20]], [30, 16, 13], [[7, 2], [7, 5], [9, 3]]),
    ]
    for batch in steps:
        np.testing.assert_allclose(ours.step(batch), theirs.step(batch), atol=3e-2, rtol=0)
    for executor in (ours, theirs):
        executor.copy_blocks([(2, 6), (5, 8)])
    for name, value in ours.pools.items():
        np.testing.assert_allclose(value.numpy().astype(np.float32), theirs.caches[name].float().numpy(), atol=1e-2)
    batch = StepBatch([[21], [22]], [31, 20], [[7, 6], [7, 8]])
    np.testing.assert_allclose(ours.step(batch), theirs.step(batch), atol=3e-2, rtol=0)


class _PagedAttention(torch.nn.Module):
    """One `paged_attention` call as a module, to export it alone."""

    def __init__(self, softcap: float, sinks: torch.Tensor | None) -> None:
        super().__init__()
        self.softcap = softcap
        self.sinks = None if sinks is None else torch.nn.Buffer(sinks)

    def forward(self, q, k, v, k_pool, v_pool, block_tables, past_lens, input_lens):
        args = (q, k, v, k_pool, v_pool, block_tables, past_lens, input_lens, 0.3, 3, self.softcap, self.sinks)
        return PAGED_ATTENTION.op(*args)


@pytest.mark.parametrize(("softcap", "sinks"), [(1.5, False), (0.0, True), (1.5, True)])
def test_paged_onnx_lowering_carries_softcap_and_sinks(softcap, sinks):
    """PagedAttention (CUDA only, float16) gets the softcap attribute and the head_sink input; its graph,
    evaluated with the Python PagedAttention above, gives the op's torch reference."""
    gen = torch.Generator().manual_seed(0)
    block, blocks, past, lens = 4, 12, [5, 0], [1, 6]
    args = (
        3 * torch.randn(1, HEADS, sum(lens), HEAD_DIM, generator=gen),
        torch.randn(1, KV_HEADS, sum(lens), HEAD_DIM, generator=gen),
        torch.randn(1, KV_HEADS, sum(lens), HEAD_DIM, generator=gen),
        torch.randn(blocks, block, KV_HEADS, HEAD_DIM, generator=gen),
        torch.randn(blocks, block, KV_HEADS, HEAD_DIM, generator=gen),
        torch.tensor([[7, 2], [9, 3]]),
        torch.tensor(past),
        torch.tensor(lens),
    )
    args = tuple(a.half() if a.is_floating_point() else a for a in args)
    module = _PagedAttention(softcap, torch.randn(HEADS, generator=gen).half() if sinks else None)
    exported = torch.onnx.export(
        torch.export.export(module, args), custom_translation_table=translations(), dynamo=True, verbose=False
    ).model_proto
    node = next(n for n in exported.graph.node if n.op_type == "PagedAttention")
    assert {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}.get("softcap", 0.0) == softcap
    assert (len(node.input) == 12 and node.input[11] != "") == sinks
    evaluator = ReferenceEvaluator(exported, new_ops=[PagedAttention])
    got = evaluator.run(None, {i.name: a.numpy() for i, a in zip(exported.graph.input, args, strict=True)})
    expected = module(*args)
    np.testing.assert_allclose(got[0].astype(np.float32), expected[0].float().numpy(), atol=2e-3)
