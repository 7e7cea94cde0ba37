"""KV cache layouts for many sequences on the ONNX Runtime CPU EP, measured on SmolLM2-135M's attention shapes.

ONNX Runtime has no CPU kernel for com.microsoft.PagedAttention, so a block-paged cache has to be read some other
way. Each variant runs an attention-only graph: 30 layers, each one GroupQueryAttention (9 query heads, 3 kv heads,
head_dim 64, float32, rotary inside the op: do_rotary=1 with cos/sin caches) over its own cache; layer l+1 takes
layer l's output as its query, every layer takes the same random key/value inputs.

    a   in place over per-sequence buffers [slots, kv_heads, 2048, head_dim]: the step's slot rows are bound with
        IO binding as both past and present (one pointer), as runtime/executors/onnx.py does. ORT <= 1.31 runs a
        sequence that brings several tokens and has a past as batch 1, so a mixed step is two session runs.
    b   gathering blocks from a pool per layer, block_size 16. Pool layout [kv_heads * num_blocks, 16, head_dim]
        (head-major): one Gather by block_table + head * num_blocks and a free Reshape give GroupQueryAttention's
        BNSH past; the op copies past to present (not in place), a Gather picks the new tokens' keys/values out of
        present, and numpy scatters them into the pool (wrapped by OrtValue.ortvalue_from_numpy, no copy).
    b2  as b with the block-major pool [num_blocks, 16, kv_heads, head_dim] (PagedAttention's layout): Gather,
        Reshape and a Transpose to BNSH.
    bh  the head-major pool of b gathered by numpy (np.take, one call per layer and key/value) into a contiguous
        scratch [batch, kv_heads, max_blocks * 16, head_dim] that is bound as past and present (in place, as in
        a); numpy then scatters the appended rows back into the pool. Same graph as a.
    c   ONNX Runtime 1.32's GroupQueryAttention with its `query_seqlens` input, in place over per-sequence
        buffers: a mixed step is one call with every sequence right-padded to the longest chunk, q/k/v fed
        padded. Runs in a subprocess under --ort132-python, next to variant a under the same 1.32.
    cp  c as a real model has to run it, so that the MatMuls need not run on padded rows: packed tokens, and per
        layer a Gather into GQA's padded packed QKV and a Gather of its output back to packed tokens.
    extra run  what one more session run costs a real q4 SmolLM2 step: a graph of five MatMuls over 105 MB of
        float32 weights (batch 1; batch 16 for comparison) and a chain of 450 Adds (node dispatch).

Context is the number of cached tokens after the step (decode at context 512 has 511 past tokens). Each row is the
median over --repeats steps after warm-up; the variants of one step shape run interleaved in one process (the 1.31
variants in this one, the 1.32 ones in the subprocess: compare c and cp with a under 1.32). KV bytes read/written
are computed per step for the 30 layers: the tokens attention reads and appends, plus every copy the variant makes
(gather padded to whole blocks, transpose, GQA's zeroing of present and copy of the past, counted once, extraction
of the new rows, scatter).

    .venv/bin/python benchmarks/kv_layouts_onnx_cpu.py [--quick] [--repeats 11] [--ort132-python /tmp/ort132/bin/python]

Needs numpy, onnx and onnxruntime only (the 1.32 venv: python3 -m venv /tmp/ort132 &&
/tmp/ort132/bin/pip install onnxruntime==1.32.0 onnx numpy).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

LAYERS, HEADS, KV_HEADS, HEAD_DIM = 30, 9, 3, 64
MAX_CONTEXT, BLOCK, THREADS = 2048, 16, 2
NUM_BLOCKS = 2048 + 1  # the largest step shape holds 64 x 512 = 16 x 2048 tokens = 2048 blocks
WEIGHT_DIMS = (2048, 2560, 2048, 2560, 2048, 2560)  # 5 MatMuls, 26.2M float32 weights = 105 MB
TOKEN_KV_BYTES = 2 * KV_HEADS * HEAD_DIM * 4 * LAYERS  # keys and values of one token, all layers (46 KB)
DEFAULT_ORT132 = "/tmp/ort132/bin/python"
MB = 1e6

Step = Callable[[], list[np.ndarray]]  # runs one step, returns the last layer's outputs of each session run


@dataclass(frozen=True)
class Seq:
    """One sequence of a step: how many tokens it brings and how many it already has cached."""

    new: int
    past: int

    @property
    def total(self) -> int:
        """Tokens cached after the step."""
        return self.new + self.past


@dataclass(frozen=True)
class Shape:
    """A step shape: the sequences it serves (sequence i uses slot i)."""

    name: str
    seqs: tuple[Seq, ...]


SHAPES = (
    Shape("decode b1 ctx512", (Seq(1, 511),)),
    Shape("decode b16 ctx512", (Seq(1, 511),) * 16),
    Shape("decode b64 ctx512", (Seq(1, 511),) * 64),
    Shape("decode b16 ctx2048", (Seq(1, 2047),) * 16),
    Shape("prefill chunk 256, past 256, b1", (Seq(256, 256),)),
    Shape("mixed: chunk 256 (past 256) + 15 decodes ctx512", (Seq(256, 256),) + (Seq(1, 511),) * 15),
)
QUICK_SHAPES = (
    "decode b16 ctx512",
    "prefill chunk 256, past 256, b1",
    "mixed: chunk 256 (past 256) + 15 decodes ctx512",
)
CHECK_SHAPES = (
    Shape("check mixed", (Seq(40, 24),) + (Seq(1, 37),) * 3),
    Shape("check decode", (Seq(1, 64),) + (Seq(1, 38),) * 3),
)


@dataclass
class Row:
    """One line of the table."""

    variant: str
    ort_version: str
    shape: str
    runs: int
    times_ms: list[float]
    read_mb: float
    written_mb: float
    load: float = field(default_factory=lambda: os.getloadavg()[0])


# ---------------------------------------------------------------------------------------------- graphs


def split_runs(shape: Shape, mixed_batches: bool) -> list[list[int]]:
    """Sequence indices per session run: ORT <= 1.31 runs a multi-token sequence with a past alone."""
    if mixed_batches:
        return [list(range(len(shape.seqs)))]
    alone = [[i] for i, s in enumerate(shape.seqs) if s.new > 1 and s.past > 0]
    rest = [i for i, s in enumerate(shape.seqs) if not (s.new > 1 and s.past > 0)]
    by_new: dict[int, list[int]] = {}
    for i in rest:
        by_new.setdefault(shape.seqs[i].new, []).append(i)
    return alone + list(by_new.values())


def rotary_caches() -> list[TensorProto]:
    """cos/sin caches [MAX_CONTEXT, head_dim / 2] for GroupQueryAttention's do_rotary."""
    inv_freq = 1.0 / (100000.0 ** (np.arange(0, HEAD_DIM, 2, dtype=np.float64) / HEAD_DIM))
    angles = np.outer(np.arange(MAX_CONTEXT), inv_freq)
    return [
        onnx.numpy_helper.from_array(np.cos(angles).astype(np.float32), "cos_cache"),
        onnx.numpy_helper.from_array(np.sin(angles).astype(np.float32), "sin_cache"),
    ]


def step_inputs() -> list[onnx.ValueInfoProto]:
    """The inputs every attention graph takes: query/key/value of the new tokens and GQA's lengths."""
    float_ = TensorProto.FLOAT
    return [
        helper.make_tensor_value_info("query", float_, ["batch", "seq", HEADS * HEAD_DIM]),
        helper.make_tensor_value_info("key", float_, ["batch", "seq", KV_HEADS * HEAD_DIM]),
        helper.make_tensor_value_info("value", float_, ["batch", "seq", KV_HEADS * HEAD_DIM]),
        helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, ["batch"]),
        helper.make_tensor_value_info("total_sequence_length", TensorProto.INT32, []),
    ]


def gqa_node(
    layer: int, qkv: list[str], past: tuple[str, str], present: tuple[str, str], seqlens: bool
) -> onnx.NodeProto:
    """One layer's GroupQueryAttention (rotary inside); with `seqlens` it takes 1.32's query_seqlens input."""
    inputs = [*qkv, *past, "seqlens_k", "total_sequence_length", "cos_cache", "sin_cache"]
    if seqlens:
        inputs += [""] * 7 + ["query_seqlens"]  # position_ids .. k_norm_weight absent, then input 16
    return helper.make_node(
        "GroupQueryAttention",
        inputs,
        [f"attn_{layer}", *present],
        name=f"gqa_{layer}",
        domain="com.microsoft",
        num_heads=HEADS,
        kv_num_heads=KV_HEADS,
        do_rotary=1,
    )


def make_model(nodes: list, inputs: list, outputs: list, initializers: list) -> bytes:
    """Serialized model, opset 21 + com.microsoft, IR version 10."""
    graph = helper.make_graph(nodes, "attention_stack", inputs, outputs, initializers)
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets, ir_version=10)
    onnx.checker.check_model(model)
    return model.SerializeToString()


def inplace_model(layers: int, query_seqlens: bool) -> bytes:
    """Variants a and c: each layer's GQA over past_key_l/past_value_l, bound to the same buffer as present."""
    cache = ["batch", KV_HEADS, "max_context", HEAD_DIM]
    inputs, outputs, nodes = step_inputs(), [], []
    if query_seqlens:
        inputs.append(helper.make_tensor_value_info("query_seqlens", TensorProto.INT32, ["batch"]))
    for layer in range(layers):
        past = (f"past_key_{layer}", f"past_value_{layer}")
        present = (f"present_key_{layer}", f"present_value_{layer}")
        inputs += [helper.make_tensor_value_info(name, TensorProto.FLOAT, cache) for name in past]
        outputs += [helper.make_tensor_value_info(name, TensorProto.FLOAT, cache) for name in present]
        query = "query" if layer == 0 else f"attn_{layer - 1}"
        nodes.append(gqa_node(layer, [query, "key", "value"], past, present, query_seqlens))
    nodes.append(helper.make_node("Identity", [f"attn_{layers - 1}"], ["output"]))
    outputs.insert(0, helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", "seq", HEADS * HEAD_DIM]))
    return make_model(nodes, inputs, outputs, rotary_caches())


def packed_model(layers: int) -> bytes:
    """Variant cp: c as a real model would run it, on packed tokens [tokens, features] (no padded MatMuls).

    Per layer: Concat(query, key, value) of the packed tokens, a Gather by pad_index [batch, seq] into GQA's
    right-padded packed QKV [batch, seq, (9 + 2 * 3) * 64], and a Gather by unpad_index [tokens] of the output
    back to packed tokens, which is the next layer's query.
    """
    int64, float_ = TensorProto.INT64, TensorProto.FLOAT
    cache = ["batch", KV_HEADS, "max_context", HEAD_DIM]
    inputs = [
        helper.make_tensor_value_info("query", float_, ["tokens", HEADS * HEAD_DIM]),
        helper.make_tensor_value_info("key", float_, ["tokens", KV_HEADS * HEAD_DIM]),
        helper.make_tensor_value_info("value", float_, ["tokens", KV_HEADS * HEAD_DIM]),
        helper.make_tensor_value_info("pad_index", int64, ["batch", "seq"]),
        helper.make_tensor_value_info("unpad_index", int64, ["tokens"]),
        helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, ["batch"]),
        helper.make_tensor_value_info("total_sequence_length", TensorProto.INT32, []),
        helper.make_tensor_value_info("query_seqlens", TensorProto.INT32, ["batch"]),
    ]
    initializers = rotary_caches() + [onnx.numpy_helper.from_array(np.array([-1, HEADS * HEAD_DIM]), "rows_shape")]
    outputs, nodes = [], []
    for layer in range(layers):
        past = (f"past_key_{layer}", f"past_value_{layer}")
        present = (f"present_key_{layer}", f"present_value_{layer}")
        inputs += [helper.make_tensor_value_info(name, float_, cache) for name in past]
        outputs += [helper.make_tensor_value_info(name, float_, cache) for name in present]
        query = "query" if layer == 0 else f"attn_packed_{layer - 1}"
        nodes += [
            helper.make_node("Concat", [query, "key", "value"], [f"qkv_{layer}"], axis=1),
            helper.make_node("Gather", [f"qkv_{layer}", "pad_index"], [f"qkv_pad_{layer}"], axis=0),
            gqa_node(layer, [f"qkv_pad_{layer}", "", ""], past, present, True),
            helper.make_node("Reshape", [f"attn_{layer}", "rows_shape"], [f"attn_rows_{layer}"]),
            helper.make_node("Gather", [f"attn_rows_{layer}", "unpad_index"], [f"attn_packed_{layer}"], axis=0),
        ]
    nodes.append(helper.make_node("Identity", [f"attn_packed_{layers - 1}"], ["output"]))
    outputs.insert(0, helper.make_tensor_value_info("output", float_, ["tokens", HEADS * HEAD_DIM]))
    return make_model(nodes, inputs, outputs, initializers)


def gather_past(layer: int, kind: str, head_major: bool) -> list[onnx.NodeProto]:
    """Nodes that gather layer `layer`'s pool `kind` (key/value) by the block table into a BNSH past."""
    pool, past = f"pool_{kind}_{layer}", f"past_{kind}_{layer}"
    if head_major:  # pool [kv_heads * blocks, 16, d]; index [batch, kv_heads, max_blocks]
        return [
            helper.make_node("Gather", [pool, "head_block_index"], [f"{past}_blocks"], axis=0),
            helper.make_node("Reshape", [f"{past}_blocks", "bnsh_shape"], [past]),  # [b, h, max_blocks * 16, d]
        ]
    return [  # pool [blocks, 16, kv_heads, d]
        helper.make_node("Gather", [pool, "block_table"], [f"{past}_blocks"], axis=0),  # [b, mb, 16, h, d]
        helper.make_node("Reshape", [f"{past}_blocks", "bshd_shape"], [f"{past}_bshd"]),
        helper.make_node("Transpose", [f"{past}_bshd"], [past], perm=[0, 2, 1, 3]),
    ]


def gather_model(layers: int, head_major: bool) -> bytes:
    """Variants b/b2: per layer, gather the pool by the block table, GQA past != present, emit the new rows."""
    int64, float_ = TensorProto.INT64, TensorProto.FLOAT
    pool_shape = [KV_HEADS * NUM_BLOCKS, BLOCK, HEAD_DIM] if head_major else [NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM]
    inputs = step_inputs() + [
        helper.make_tensor_value_info("block_table", int64, ["batch", "max_blocks"]),
        helper.make_tensor_value_info("new_rows", int64, ["batch", KV_HEADS, "seq"]),  # rows of present, flattened
    ]
    initializers = rotary_caches() + [
        onnx.numpy_helper.from_array(np.array([0, 0, -1, HEAD_DIM], np.int64), "bnsh_shape")
        if head_major
        else onnx.numpy_helper.from_array(np.array([0, -1, KV_HEADS, HEAD_DIM], np.int64), "bshd_shape"),
        onnx.numpy_helper.from_array(np.array([-1, HEAD_DIM], np.int64), "rows_shape"),
        onnx.numpy_helper.from_array(np.array([1], np.int64), "axis_1"),
        onnx.numpy_helper.from_array((np.arange(KV_HEADS, dtype=np.int64) * NUM_BLOCKS)[:, None], "head_offsets"),
    ]
    nodes = [
        helper.make_node("Unsqueeze", ["block_table", "axis_1"], ["block_table_1"]),
        helper.make_node("Add", ["block_table_1", "head_offsets"], ["head_block_index"]),  # [b, h, max_blocks]
    ]
    outputs = [helper.make_tensor_value_info("output", float_, ["batch", "seq", HEADS * HEAD_DIM])]
    for layer in range(layers):
        for kind in ("key", "value"):
            inputs.append(helper.make_tensor_value_info(f"pool_{kind}_{layer}", float_, pool_shape))
            nodes += gather_past(layer, kind, head_major)
        present = (f"present_key_{layer}", f"present_value_{layer}")
        qkv = ["query" if layer == 0 else f"attn_{layer - 1}", "key", "value"]
        nodes.append(gqa_node(layer, qkv, (f"past_key_{layer}", f"past_value_{layer}"), present, False))
        for kind, name in zip(("key", "value"), present, strict=True):
            nodes.append(helper.make_node("Reshape", [name, "rows_shape"], [f"{name}_rows"]))
            nodes.append(helper.make_node("Gather", [f"{name}_rows", "new_rows"], [f"new_{kind}_{layer}"], axis=0))
            outputs.append(helper.make_tensor_value_info(f"new_{kind}_{layer}", float_, ["batch", KV_HEADS, "seq", 64]))
    nodes.append(helper.make_node("Identity", [f"attn_{layers - 1}"], ["output"]))
    return make_model(nodes, inputs, outputs, initializers)


def weights_model() -> bytes:
    """Five chained MatMuls over ~105 MB of float32 weights: one decode step's weight read."""
    rng = np.random.default_rng(1)
    nodes, initializers = [], []
    for i, (k, n) in enumerate(zip(WEIGHT_DIMS, WEIGHT_DIMS[1:], strict=False)):
        weight = (rng.standard_normal((k, n), dtype=np.float32) / np.sqrt(k)).astype(np.float32)
        initializers.append(onnx.numpy_helper.from_array(weight, f"w{i}"))
        nodes.append(helper.make_node("MatMul", ["x" if i == 0 else f"h{i - 1}", f"w{i}"], [f"h{i}"]))
    last = f"h{len(nodes) - 1}"
    nodes.append(helper.make_node("Identity", [last], ["y"]))
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", WEIGHT_DIMS[0]])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", WEIGHT_DIMS[-1]])
    return make_model(nodes, [x], [y], initializers)


def dispatch_model(nodes: int = 450) -> bytes:
    """A chain of `nodes` Adds on [batch, 576]: a real model's per-run node dispatch (30 layers x ~15 nodes)."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", HEADS * HEAD_DIM])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", HEADS * HEAD_DIM])
    one = onnx.numpy_helper.from_array(np.ones(HEADS * HEAD_DIM, np.float32), "one")
    chain = [helper.make_node("Add", ["x" if i == 0 else f"t{i - 1}", "one"], [f"t{i}"]) for i in range(nodes)]
    chain.append(helper.make_node("Identity", [f"t{nodes - 1}"], ["y"]))
    return make_model(chain, [x], [y], [one])


def session(model: bytes) -> ort.InferenceSession:
    """CPU session with THREADS intra-op threads and all graph optimizations."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = THREADS
    options.inter_op_num_threads = 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])


# ---------------------------------------------------------------------------------------------- step inputs


@dataclass
class StepData:
    """What every variant of one step shape shares: cache contents and the new tokens' q/k/v per sequence."""

    shape: Shape
    content: np.ndarray  # [seqs, 2 (k/v), kv_heads, max total, head_dim]: cached tokens, same in every layer
    query: list[np.ndarray]  # per sequence [new, heads * d]
    key: list[np.ndarray]  # per sequence [new, kv_heads * d]
    value: list[np.ndarray]


def step_data(shape: Shape, seed: int = 0) -> StepData:
    """Random cache contents and new tokens for `shape`."""
    rng = np.random.default_rng(seed)
    longest = max(s.total for s in shape.seqs)
    content = rng.standard_normal((len(shape.seqs), 2, KV_HEADS, longest, HEAD_DIM), dtype=np.float32)
    query = [rng.standard_normal((s.new, HEADS * HEAD_DIM), dtype=np.float32) for s in shape.seqs]
    key = [rng.standard_normal((s.new, KV_HEADS * HEAD_DIM), dtype=np.float32) for s in shape.seqs]
    value = [rng.standard_normal((s.new, KV_HEADS * HEAD_DIM), dtype=np.float32) for s in shape.seqs]
    return StepData(shape, content, query, key, value)


def padded(rows: list[np.ndarray], width: int) -> np.ndarray:
    """[len(rows), width, features]: each sequence's rows, right-padded with zeros."""
    out = np.zeros((len(rows), width, rows[0].shape[1]), np.float32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


def bind_common(binding: ort.IOBinding, data: StepData, idx: list[int], width: int) -> None:
    """Bind query/key/value (right-padded to `width`) and the GQA lengths of sequences `idx`."""
    seqs = [data.shape.seqs[i] for i in idx]
    binding.bind_output("output", "cpu")  # bound first: get_outputs()[0]
    binding.bind_cpu_input("query", padded([data.query[i] for i in idx], width))
    binding.bind_cpu_input("key", padded([data.key[i] for i in idx], width))
    binding.bind_cpu_input("value", padded([data.value[i] for i in idx], width))
    binding.bind_cpu_input("seqlens_k", np.array([s.total - 1 for s in seqs], np.int32))
    binding.bind_cpu_input("total_sequence_length", np.array(max(s.total for s in seqs), np.int32))


def bind_packed(binding: ort.IOBinding, data: StepData, idx: list[int], width: int) -> None:
    """Bind packed query/key/value of sequences `idx`, the pad/unpad indices and GQA's lengths (variant cp)."""
    seqs = [data.shape.seqs[i] for i in idx]
    binding.bind_output("output", "cpu")  # bound first: get_outputs()[0]
    for name, rows in (("query", data.query), ("key", data.key), ("value", data.value)):
        binding.bind_cpu_input(name, np.concatenate([rows[i] for i in idx]))
    starts = np.cumsum([0] + [s.new for s in seqs])[:-1]
    pad_index = np.zeros((len(seqs), width), np.int64)  # padding rows read token 0 (ignored by GQA)
    for row, (start, seq) in enumerate(zip(starts, seqs, strict=True)):
        pad_index[row, : seq.new] = start + np.arange(seq.new)
    unpad_index = np.concatenate([row * width + np.arange(s.new) for row, s in enumerate(seqs)])
    binding.bind_cpu_input("pad_index", pad_index)
    binding.bind_cpu_input("unpad_index", unpad_index.astype(np.int64))
    binding.bind_cpu_input("seqlens_k", np.array([s.total - 1 for s in seqs], np.int32))
    binding.bind_cpu_input("total_sequence_length", np.array(max(s.total for s in seqs), np.int32))


def run_binding(sess: ort.InferenceSession, binding: ort.IOBinding) -> np.ndarray:
    """Run once; returns the last layer's attention output."""
    binding.bind_output("output", "cpu")
    sess.run_with_iobinding(binding)
    return binding.get_outputs()[0].numpy()


# ---------------------------------------------------------------------------------------------- variant a / c


class SlotCaches:
    """Per-layer caches [slots, kv_heads, MAX_CONTEXT, d] holding each sequence's past (variants a and c share it)."""

    def __init__(self, data: StepData, layers: int) -> None:
        slots = len(data.shape.seqs)
        self.arrays = [np.zeros((slots, KV_HEADS, MAX_CONTEXT, HEAD_DIM), np.float32) for _ in range(2 * layers)]
        for layer in range(layers):
            for kv in range(2):
                for slot, seq in enumerate(data.shape.seqs):
                    self.arrays[2 * layer + kv][slot, :, : seq.past] = data.content[slot, kv, :, : seq.past]
        self.values = [ort.OrtValue.ortvalue_from_numpy(a) for a in self.arrays]

    def bind(self, binding: ort.IOBinding, layer: int, first: int, count: int) -> None:
        """Bind slots first..first+count of layer `layer` as past and present (one pointer: in place)."""
        row = KV_HEADS * MAX_CONTEXT * HEAD_DIM * 4
        for kv, name in enumerate(("key", "value")):
            pointer = self.values[2 * layer + kv].data_ptr() + first * row
            shape = [count, KV_HEADS, MAX_CONTEXT, HEAD_DIM]
            binding.bind_input(f"past_{name}_{layer}", "cpu", 0, np.float32, shape, pointer)
            binding.bind_output(f"present_{name}_{layer}", "cpu", 0, np.float32, shape, pointer)


def inplace_step(
    sess: ort.InferenceSession,
    caches: SlotCaches,
    data: StepData,
    layers: int,
    mixed_batches: bool,
    packed: bool = False,
) -> tuple[Step, list[list[int]]]:
    """Variant a (ORT 1.31 rules), c (one run, query_seqlens) or cp (c on packed tokens); returns (step, runs)."""
    bindings, runs = [], split_runs(data.shape, mixed_batches)
    for idx in runs:
        assert idx == list(range(idx[0], idx[-1] + 1)), "slots of a run must be consecutive"
        binding = sess.io_binding()
        width = max(data.shape.seqs[i].new for i in idx)
        if packed:
            bind_packed(binding, data, idx, width)
        else:
            bind_common(binding, data, idx, width)
        if mixed_batches:
            binding.bind_cpu_input("query_seqlens", np.array([data.shape.seqs[i].new for i in idx], np.int32))
        for layer in range(layers):
            caches.bind(binding, layer, idx[0], len(idx))
        bindings.append(binding)
    return (lambda: [run_binding(sess, b) for b in bindings]), runs


# ---------------------------------------------------------------------------------------------- variant b


class BlockPool:
    """Per-layer key/value pools of NUM_BLOCKS blocks, sequences' blocks scattered at random (numpy arrays)."""

    def __init__(self, data: StepData, layers: int, head_major: bool, reserve: int = 0, seed: int = 0) -> None:
        self.head_major = head_major
        needed = [-(-(s.total + reserve) // BLOCK) for s in data.shape.seqs]  # reserve: room for later steps
        order = np.random.default_rng(seed).permutation(NUM_BLOCKS)[: sum(needed)]
        self.tables = np.zeros((len(needed), max(needed)), np.int64)
        start = 0
        for i, n in enumerate(needed):
            self.tables[i, :n] = order[start : start + n]
            start += n
        shape = (KV_HEADS, NUM_BLOCKS, BLOCK, HEAD_DIM) if head_major else (NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM)
        self.arrays = [np.zeros(shape, np.float32) for _ in range(2 * layers)]
        for i, seq in enumerate(data.shape.seqs):
            positions = np.arange(seq.past)
            for layer in range(layers):
                for kv in range(2):
                    self.scatter(2 * layer + kv, i, positions, data.content[i, kv, :, : seq.past])
        flat = (KV_HEADS * NUM_BLOCKS, BLOCK, HEAD_DIM) if head_major else shape
        self.values = [ort.OrtValue.ortvalue_from_numpy(a.reshape(flat)) for a in self.arrays]

    def slots(self, seq: int | np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(block, offset) of token positions of sequence(s) `seq` (indices broadcast against `positions`)."""
        return self.tables[seq, positions // BLOCK], positions % BLOCK

    def scatter(self, array: int, seq: int, positions: np.ndarray, rows: np.ndarray) -> None:
        """Write rows [kv_heads, len(positions), d] of sequence `seq` at `positions` of pool `array`."""
        block, offset = self.slots(seq, positions)
        if self.head_major:
            self.arrays[array][:, block, offset] = rows
        else:
            self.arrays[array][block, offset] = rows.transpose(1, 0, 2)


def gather_step(
    sess: ort.InferenceSession, pool: BlockPool, data: StepData, layers: int
) -> tuple[Step, list[list[int]]]:
    """Variant b/b2: each run gathers its sequences' blocks; the step ends with numpy scattering the new rows."""
    runs, split = [], split_runs(data.shape, False)
    for idx in split:
        binding = sess.io_binding()
        seqs = [data.shape.seqs[i] for i in idx]
        width = seqs[0].new  # split_runs groups sequences that bring the same number of tokens
        bind_common(binding, data, idx, width)
        max_blocks = max(-(-s.total // BLOCK) for s in seqs)
        binding.bind_cpu_input("block_table", np.ascontiguousarray(pool.tables[idx, :max_blocks]))
        present_len = max_blocks * BLOCK  # GQA's present: max(total_sequence_length, past length)
        heads = np.arange(KV_HEADS)[None, :, None]
        starts = np.array([s.past for s in seqs])[:, None, None] + np.arange(width)[None, None, :]
        rows = (np.arange(len(seqs))[:, None, None] * KV_HEADS + heads) * present_len + starts  # [b, h, new]
        binding.bind_cpu_input("new_rows", rows.astype(np.int64))
        outputs = []
        for layer in range(layers):
            binding.bind_ortvalue_input(f"pool_key_{layer}", pool.values[2 * layer])
            binding.bind_ortvalue_input(f"pool_value_{layer}", pool.values[2 * layer + 1])
            for kind in ("key", "value"):
                out = np.empty((len(idx), KV_HEADS, width, HEAD_DIM), np.float32)
                binding.bind_output(f"new_{kind}_{layer}", "cpu", 0, np.float32, list(out.shape), out.ctypes.data)
                outputs.append(out)
        block, offset = pool.slots(np.array(idx)[:, None], starts[:, 0, :])  # [b, new] each
        runs.append((binding, outputs, block, offset))

    def step() -> list[np.ndarray]:
        results = []
        for binding, outputs, block, offset in runs:
            results.append(run_binding(sess, binding))
            for array, out in zip(pool.arrays, outputs, strict=True):  # one fancy-index write per layer and key/value
                if pool.head_major:
                    array[:, block, offset] = out.transpose(1, 0, 2, 3)
                else:
                    array[block, offset] = out.transpose(0, 2, 1, 3)
        return results

    return step, split


def host_gather_step(
    sess: ort.InferenceSession, pool: BlockPool, data: StepData, layers: int
) -> tuple[Step, list[list[int]]]:
    """Variant bh: numpy gathers the blocks into a contiguous scratch bound as GQA's past and present (in place)."""
    runs, split = [], split_runs(data.shape, False)
    for idx in split:
        binding = sess.io_binding()
        seqs = [data.shape.seqs[i] for i in idx]
        width = seqs[0].new  # split_runs groups sequences that bring the same number of tokens
        bind_common(binding, data, idx, width)
        max_blocks = max(-(-s.total // BLOCK) for s in seqs)
        index = pool.tables[idx, None, :max_blocks] + (np.arange(KV_HEADS) * NUM_BLOCKS)[None, :, None]
        shape = [len(idx), KV_HEADS, max_blocks * BLOCK, HEAD_DIM]
        scratch = [np.empty(shape, np.float32) for _ in range(2 * layers)]
        for layer in range(layers):
            for kv, name in enumerate(("key", "value")):
                pointer = scratch[2 * layer + kv].ctypes.data
                binding.bind_input(f"past_{name}_{layer}", "cpu", 0, np.float32, shape, pointer)
                binding.bind_output(f"present_{name}_{layer}", "cpu", 0, np.float32, shape, pointer)
        positions = np.array([s.past for s in seqs])[:, None] + np.arange(width)[None, :]  # [b, new]
        block, offset = pool.slots(np.array(idx)[:, None], positions)
        runs.append((binding, scratch, index, positions, block, offset))

    def step() -> list[np.ndarray]:
        results = []
        for binding, scratch, index, positions, block, offset in runs:
            for array, buffer in zip(pool.arrays, scratch, strict=True):  # [b, h, max_blocks, 16, d] = [b, h, L, d]
                np.take(array.reshape(-1, BLOCK, HEAD_DIM), index, axis=0, out=buffer.reshape(*index.shape, BLOCK, -1))
            results.append(run_binding(sess, binding))
            rows = np.arange(len(positions))[:, None]
            for array, buffer in zip(pool.arrays, scratch, strict=True):
                array[:, block, offset] = buffer[rows, :, positions].transpose(2, 0, 1, 3)  # [b, new, h, d] -> h first
        return results

    return step, split


# ---------------------------------------------------------------------------------------------- measuring

IN_PLACE = ("a", "c", "cp")


def sessions(variants: tuple[str, ...], layers: int) -> dict[str, ort.InferenceSession]:
    """One session per variant (the step shapes are dynamic dimensions of one graph)."""
    models = {
        "a": lambda: inplace_model(layers, False),
        "c": lambda: inplace_model(layers, True),
        "cp": lambda: packed_model(layers),
        "b": lambda: gather_model(layers, True),
        "b2": lambda: gather_model(layers, False),
        "bh": lambda: inplace_model(layers, False),
    }
    return {v: session(models[v]()) for v in variants}


def build_state(variants: tuple[str, ...], data: StepData, layers: int, reserve: int = 0) -> dict[str, object]:
    """The caches each variant reads: a, c and cp share per-sequence buffers, b, b2 and bh have their own pools."""
    state: dict[str, object] = {}
    slot_caches = SlotCaches(data, layers) if any(v in IN_PLACE for v in variants) else None
    for v in variants:
        state[v] = slot_caches if v in IN_PLACE else BlockPool(data, layers, v != "b2", reserve)
    return state


def make_step(
    variant: str, sess: ort.InferenceSession, state: object, data: StepData, layers: int
) -> tuple[Step, list[list[int]]]:
    """The step callable of `variant` for `data`, and the sequence indices of each of its session runs."""
    if variant in IN_PLACE:
        assert isinstance(state, SlotCaches)
        return inplace_step(sess, state, data, layers, variant != "a", variant == "cp")
    assert isinstance(state, BlockPool)
    if variant == "bh":
        return host_gather_step(sess, state, data, layers)
    return gather_step(sess, state, data, layers)


def valid_rows(results: list[np.ndarray], runs: list[list[int]], shape: Shape) -> np.ndarray:
    """Every sequence's new-token outputs, in sequence order, padding dropped: [tokens, hidden]."""
    per_seq: dict[int, np.ndarray] = {}
    for result, idx in zip(results, runs, strict=True):
        if result.ndim == 2:  # packed tokens (variant cp)
            result = np.split(result, np.cumsum([shape.seqs[i].new for i in idx])[:-1])
        for row, i in enumerate(idx):
            per_seq[i] = result[row][: shape.seqs[i].new]
    return np.concatenate([per_seq[i] for i in range(len(shape.seqs))])


def check_equivalence(variants: tuple[str, ...], layers: int = 2) -> str:
    """Two steps (a mixed one, then decodes that read what it wrote) give the same outputs in every variant."""
    first, second = (step_data(shape, seed) for seed, shape in enumerate(CHECK_SHAPES))
    sess = sessions(variants, layers)
    state = build_state(variants, first, layers, reserve=BLOCK)
    outputs: dict[str, list[np.ndarray]] = {}
    for v in variants:
        outputs[v] = []
        for data in (first, second):
            step, runs = make_step(v, sess[v], state[v], data, layers)
            outputs[v].append(valid_rows(step(), runs, data.shape))
    reference = outputs[variants[0]]
    diffs = []
    for v in variants[1:]:
        diff = max(float(np.abs(o - r).max()) for o, r in zip(outputs[v], reference, strict=True))
        diffs.append(f"{v} vs {variants[0]}: max |diff| {diff:.1e}")
    return "; ".join(diffs)


def check_shared_memory() -> str:
    """Does OrtValue.ortvalue_from_numpy wrap a CPU array without copying? (pointer and a write through numpy)"""
    array = np.zeros((4, 16, 64), np.float32)
    value = ort.OrtValue.ortvalue_from_numpy(array)
    same_pointer = value.data_ptr() == array.ctypes.data
    array[1, 2, 3] = 7.0
    sees_write = float(value.numpy()[1, 2, 3]) == 7.0
    return f"ortvalue_from_numpy shares memory: pointer equal {same_pointer}, numpy write visible {sees_write}"


def kv_traffic(variant: str, shape: Shape) -> tuple[float, float]:
    """(MB read, MB written) of keys/values per step, all layers, from the variant's copies."""
    if variant in IN_PLACE:  # attention reads each sequence's cache, the op appends the new rows
        read = sum(s.total for s in shape.seqs)
        written = sum(s.new for s in shape.seqs)
        return read * TOKEN_KV_BYTES / MB, written * TOKEN_KV_BYTES / MB
    read = written = 0
    for idx in split_runs(shape, False):
        seqs = [shape.seqs[i] for i in idx]
        gathered = len(seqs) * max(-(-s.total // BLOCK) for s in seqs) * BLOCK  # padded to whole blocks
        past, total, new = (sum(getattr(s, a) for s in seqs) for a in ("past", "total", "new"))
        if variant == "bh":  # numpy gather, in-place append, numpy scatter
            read += gathered + total + new
            written += gathered + 2 * new
            continue
        # graph gather (+ transpose for b2); GQA zeroes present, copies the past (once, at least) and appends;
        # a Gather extracts the new rows and numpy scatters them
        transposed = gathered if variant == "b2" else 0
        read += gathered + transposed + past + total + 2 * new
        written += gathered + transposed + gathered + past + 3 * new
    return read * TOKEN_KV_BYTES / MB, written * TOKEN_KV_BYTES / MB


def time_steps(steps: dict[str, Step], repeats: int, warmup: int) -> dict[str, list[float]]:
    """Milliseconds per step of each variant, runs interleaved across variants after warm-up."""
    for step in steps.values():
        for _ in range(warmup):
            step()
    times: dict[str, list[float]] = {v: [] for v in steps}
    for _ in range(repeats):
        for v, step in steps.items():
            start = time.perf_counter()
            step()
            times[v].append((time.perf_counter() - start) * 1e3)
    return times


def measure_shapes(variants: tuple[str, ...], shapes: list[Shape], repeats: int, warmup: int) -> list[Row]:
    """Time every variant on every step shape; caches are built per shape and freed after it."""
    sess = sessions(variants, LAYERS)
    rows = []
    for shape in shapes:
        data = step_data(shape)
        state = build_state(variants, data, LAYERS)
        built = {v: make_step(v, sess[v], state[v], data, LAYERS) for v in variants}
        times = time_steps({v: step for v, (step, _) in built.items()}, repeats, warmup)
        for v in variants:
            read, written = kv_traffic(v, shape)
            rows.append(Row(v, ort.__version__, shape.name, len(built[v][1]), times[v], read, written))
        print(
            f"  {shape.name}: " + ", ".join(f"{v} {statistics.median(t):.1f} ms" for v, t in times.items()),
            file=sys.stderr,
        )
        del state, built
        gc.collect()
    return rows


def measure_extra_run(repeats: int, warmup: int) -> list[Row]:
    """One extra session run: the ~105 MB MatMul graph at batch 1 and 16, and 450 nodes' dispatch."""
    weights, dispatch = session(weights_model()), session(dispatch_model())
    weights_mb = sum(k * n for k, n in zip(WEIGHT_DIMS, WEIGHT_DIMS[1:], strict=False)) * 4 / MB
    rng = np.random.default_rng(0)
    runs = {
        "matmuls b1": (weights, rng.standard_normal((1, WEIGHT_DIMS[0]), dtype=np.float32)),
        "matmuls b16": (weights, rng.standard_normal((16, WEIGHT_DIMS[0]), dtype=np.float32)),
        "450 Adds b1": (dispatch, rng.standard_normal((1, HEADS * HEAD_DIM), dtype=np.float32)),
    }
    steps = {name: (lambda s=s, x=x: s.run(None, {"x": x})) for name, (s, x) in runs.items()}
    times = time_steps(steps, repeats, warmup)
    variants = {"matmuls b1": f"extra run ({weights_mb:.0f} MB weights)", "450 Adds b1": "extra run (dispatch)"}
    variants["matmuls b16"] = variants["matmuls b1"]
    return [Row(variants[name], ort.__version__, name, 1, t, 0, 0) for name, t in times.items()]


# ---------------------------------------------------------------------------------------------- report


def run_ort132(python: str, args: argparse.Namespace) -> tuple[list[Row], list[str]]:
    """Variants a and c under ONNX Runtime 1.32, in a subprocess of `python`; ([], [why]) where it cannot run."""
    if not Path(python).exists():
        return [], [f"variant c skipped: no ONNX Runtime 1.32 python at {python} (see --ort132-python)"]
    command = [python, __file__, "--worker", "--repeats", str(args.repeats), "--warmup", str(args.warmup)]
    if args.quick:
        command.append("--quick")
    done = subprocess.run(command, capture_output=True, text=True)
    sys.stderr.write(done.stderr)
    if done.returncode != 0:
        return [], [f"variant c failed under {python} (exit {done.returncode}): {done.stderr.strip()[-2000:]}"]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    return [Row(**row) for row in report["rows"]], report["notes"]


def table(rows: list[Row]) -> str:
    """The markdown table: one row per (variant, step shape)."""
    lines = [
        "| variant | ORT | step shape | runs | median ms | min–max ms | KV read MB | KV written MB | load 1 min |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        kv = ("–", "–") if not r.read_mb else (f"{r.read_mb:.1f}", f"{r.written_mb:.2f}")
        lines.append(
            f"| {r.variant} | {r.ort_version} | {r.shape} | {r.runs} | {statistics.median(r.times_ms):.2f} | "
            f"{min(r.times_ms):.2f}–{max(r.times_ms):.2f} | {kv[0]} | {kv[1]} | {r.load:.2f} |"
        )
    return "\n".join(lines)


def row_order(row: Row) -> tuple[int, str, str]:
    """Table order: step shapes as in SHAPES, the extra-run rows last; variants alphabetical within a shape."""
    names = [s.name for s in SHAPES]
    return (names.index(row.shape) if row.shape in names else len(names), row.variant, row.shape)


def split_cost(rows: list[Row]) -> str:
    """The mixed step with each extra session run charged one weight read (the batch-16 MatMul graph's median)."""
    weights = [t for r in rows if r.shape == "matmuls b1" for t in r.times_ms]  # measured first and last
    dispatch = [t for r in rows if r.shape == "450 Adds b1" for t in r.times_ms]
    mixed = [r for r in rows if r.shape == SHAPES[-1].name]
    if not weights or not dispatch or not mixed:
        return ""
    run_ms = statistics.median(weights) + statistics.median(dispatch)
    lines = [
        f"Mixed step in a real model: attention + (runs - 1) x {run_ms:.1f} ms, the cost of one more session run "
        f"(median 105 MB weight read at batch 1 {statistics.median(weights):.1f} ms + 450-node dispatch "
        f"{statistics.median(dispatch):.1f} ms; the decode rows' FLOPs are paid in either split)"
    ]
    for r in mixed:
        attention = statistics.median(r.times_ms)
        lines.append(
            f"- {r.variant} (ORT {r.ort_version}): {attention:.1f} + {r.runs - 1} x {run_ms:.1f} = "
            f"{attention + (r.runs - 1) * run_ms:.1f} ms"
        )
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    """Command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="three step shapes, 3 repeats")
    parser.add_argument("--repeats", type=int, default=11, help="timed steps per (variant, shape)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--ort132-python", default=DEFAULT_ORT132, help="python of a venv with onnxruntime 1.32")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # the 1.32 subprocess
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.warmup = min(args.repeats, 3), 1
    return args


def chosen_shapes(quick: bool) -> list[Shape]:
    """All step shapes, or the --quick subset."""
    return [s for s in SHAPES if not quick or s.name in QUICK_SHAPES]


def worker(args: argparse.Namespace) -> None:
    """Under ONNX Runtime 1.32: check and time variants a and c, print one JSON line."""
    notes = [f"ORT {ort.__version__} check (2 layers, mixed step then decode): {check_equivalence(IN_PLACE)}"]
    rows = measure_shapes(IN_PLACE, chosen_shapes(args.quick), args.repeats, args.warmup)
    print(json.dumps({"rows": [r.__dict__ for r in rows], "notes": notes}))


def main() -> None:
    """Measure, then print the notes and the table."""
    args = parse_args()
    if args.worker:
        worker(args)
        return
    variants = ("a", "b", "b2", "bh")
    notes = [check_shared_memory()]
    notes.append(f"ORT {ort.__version__} check (2 layers, mixed step then decode): {check_equivalence(variants)}")
    load_before = os.getloadavg()
    rows = measure_extra_run(args.repeats, args.warmup)
    rows += measure_shapes(variants, chosen_shapes(args.quick), args.repeats, args.warmup)
    more, more_notes = run_ort132(args.ort132_python, args)
    rows += more + measure_extra_run(args.repeats, args.warmup)
    notes += more_notes
    notes.append(f"load average (1/5/15 min) before {load_before}, after {os.getloadavg()}; {os.cpu_count()} CPUs")
    print("\n".join(notes))
    print()
    print(table(sorted(rows, key=row_order)))
    print()
    print(split_cost(rows))


if __name__ == "__main__":
    main()
