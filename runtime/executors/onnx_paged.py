"""Executor on ONNX Runtime's CUDA EP for PAGED programs (needs numpy and onnxruntime only).

Each layer's key and value pools [num_blocks, block_size, kv_heads, head_dim] are allocated once on the GPU as
OrtValues and bound (IO binding) as both the model's pool input k_pool_<i> and its output present_k_pool_<i>:
com.microsoft.PagedAttention writes the step's keys and values into them in place (it refuses a key_cache_out
that is not key_cache's buffer), so no step copies the cache. A step binds the packed batch's small inputs
from the host (ONNX Runtime uploads them) and reads back the logits, float32 for the sequences' last tokens.

Block copies (copy-on-write of a shared prefix block) run on the GPU too: a second, tiny InferenceSession
gathers the source blocks of every pool and scatters them onto the destinations (Gather + ScatterND), with
each pool bound as its input and its output; ScatterND skips its input-to-output copy when they are the same
buffer, so only the copied blocks move. Pools start zeroed (Expand of a zero into the bound pools): positions
a kernel reads past a sequence's end then hold zeros, never stale NaNs. Those helper models are encoded here
(a few protobuf fields), since the runtime does not depend on the onnx package.

ONNX Runtime falls back to its CPU EP when it cannot start the CUDA EP (no GPU, or CUDA libraries missing),
and PagedAttention has no CPU kernel: the executor checks which EP a session really got and says so.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from ...errors import GenerationError
from ...step_io import (
    BLOCK_TABLES,
    INPUT_IDS,
    INPUT_LENS,
    LOGITS,
    PAST_LENS,
    POSITION_IDS,
    PRESENT_PREFIX,
    KVLayout,
    cache_layer,
)
from ..executor import Executor, PackedBatch, StepBatch, last_token_logits, pack_batch, sequential_block_tables
from .onnx import session_options

CUDA = "CUDAExecutionProvider"
DEFAULT_SEQUENCES = 4  # KV room when no pool size is given: this many sequences of max_context
FLOAT16, BFLOAT16, INT64 = 10, 16, 7  # ONNX element types (TensorProto.DataType)
POOL_TYPES = {"tensor(float16)": FLOAT16, "tensor(bfloat16)": BFLOAT16}
HELPER_IR_VERSION, HELPER_OPSET = 8, 18


def cuda_unavailable(offered: Sequence[str] | None = None) -> GenerationError:
    """The error for a host where ONNX Runtime cannot run CUDA sessions, naming what it offers."""
    offered = list(ort.get_available_providers() if offered is None else offered)
    message = f"this artifact needs the CUDA execution provider; onnxruntime here offers {', '.join(offered)}"
    if CUDA in offered:
        message += (
            f" but could not start {CUDA} (no usable NVIDIA GPU, or the CUDA / cuDNN libraries it loads are "
            "missing: onnxruntime's log above names them)"
        )
    else:
        message += " (install onnxruntime-gpu, on a machine with an NVIDIA GPU)"
    return GenerationError(message)


# ---------------------------------------------------------------- helper models, as ONNX protobuf bytes


def _varint(value: int) -> bytes:
    value &= (1 << 64) - 1  # negative int64s as ten-byte two's complement, as protobuf does
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _int(field: int, value: int) -> bytes:
    return _varint(field << 3) + _varint(value)


def _bytes(field: int, payload: bytes | str) -> bytes:
    payload = payload.encode() if isinstance(payload, str) else payload
    return _varint(field << 3 | 2) + _varint(len(payload)) + payload


def _value_info(name: str, element_type: int, dims: Sequence[int | str]) -> bytes:
    """ValueInfoProto: name, TypeProto.tensor_type (elem_type, shape of dim_value / dim_param)."""
    shape = b"".join(_bytes(1, _int(1, d) if isinstance(d, int) else _bytes(2, d)) for d in dims)
    tensor_type = _int(1, element_type) + _bytes(2, shape)
    return _bytes(1, name) + _bytes(2, _bytes(1, tensor_type))


def _node(op_type: str, inputs: Sequence[str], outputs: Sequence[str], *attributes: bytes) -> bytes:
    fields = [_bytes(1, i) for i in inputs] + [_bytes(2, o) for o in outputs]
    return b"".join(fields) + _bytes(4, op_type) + b"".join(_bytes(5, a) for a in attributes)


def _int_attribute(name: str, value: int) -> bytes:
    return _bytes(1, name) + _int(3, value) + _int(20, 2)  # type INT


def _zero(name: str, element_type: int) -> bytes:
    """A scalar TensorProto initializer holding zero (raw little-endian bytes)."""
    size = 2 if element_type in (FLOAT16, BFLOAT16) else 8
    return _int(2, element_type) + _bytes(8, name) + _bytes(9, bytes(size))


def _model(
    nodes: Sequence[bytes], inputs: Sequence[bytes], outputs: Sequence[bytes], initializers: Sequence[bytes] = ()
) -> bytes:
    graph = b"".join(_bytes(1, n) for n in nodes) + _bytes(2, "llmlower_pools")
    graph += b"".join(_bytes(5, t) for t in initializers)
    graph += b"".join(_bytes(11, i) for i in inputs) + b"".join(_bytes(12, o) for o in outputs)
    opset = _bytes(1, "") + _int(2, HELPER_OPSET)
    return _int(1, HELPER_IR_VERSION) + _bytes(2, "llmlower") + _bytes(7, graph) + _bytes(8, opset)


POOL_DIMS = ("blocks", "block_size", "kv_heads", "head_dim")


def copy_blocks_model(pools: int, element_type: int) -> bytes:
    """pool_i [blocks, ...], src [pairs], dst [pairs, 1] -> out_i: pool_i with blocks src copied onto dst."""
    nodes, inputs, outputs = [], [], []
    for i in range(pools):
        nodes.append(_node("Gather", [f"pool_{i}", "src"], [f"blocks_{i}"], _int_attribute("axis", 0)))
        nodes.append(_node("ScatterND", [f"pool_{i}", "dst", f"blocks_{i}"], [f"out_{i}"]))
        inputs.append(_value_info(f"pool_{i}", element_type, POOL_DIMS))
        outputs.append(_value_info(f"out_{i}", element_type, POOL_DIMS))
    inputs += [_value_info("src", INT64, ["pairs"]), _value_info("dst", INT64, ["pairs", 1])]
    return _model(nodes, inputs, outputs)


def fill_zeros_model(pools: int, element_type: int) -> bytes:
    """shape [4] -> out_i: zeros of that shape, Expand of a zero scalar (any element type; one node per
    output, each bound to its own pool)."""
    nodes = [_node("Expand", ["zero", "shape"], [f"out_{i}"]) for i in range(pools)]
    outputs = [_value_info(f"out_{i}", element_type, POOL_DIMS) for i in range(pools)]
    return _model(nodes, [_value_info("shape", INT64, [4])], outputs, [_zero("zero", element_type)])


def copy_rounds(pairs: Sequence[tuple[int, int]]) -> list[tuple[list[int], list[int]]]:
    """Split (source, destination) copies into runs of one gather-then-scatter each, keeping the result of
    copying one pair after another: a run ends before a pair that reads or rewrites a block it writes."""
    rounds: list[tuple[list[int], list[int]]] = []
    written: set[int] = set()
    for source, destination in pairs:
        if not rounds or source in written or destination in written:
            rounds.append(([], []))
            written = set()
        rounds[-1][0].append(source)
        rounds[-1][1].append(destination)
        written.add(destination)
    return rounds


def require_cuda(provider: str | tuple[str, dict[str, Any]] = CUDA) -> None:
    """Raise cuda_unavailable() unless ONNX Runtime really starts the CUDA EP: it lists the EP whenever the
    onnxruntime-gpu wheel is installed, then falls back to its CPU EP (logging why) if the EP will not start."""
    if CUDA not in ort.get_available_providers():
        raise cuda_unavailable()
    probe = ort.InferenceSession(fill_zeros_model(1, FLOAT16), providers=[provider])
    if CUDA not in probe.get_providers():
        raise cuda_unavailable()


class DevicePools:
    """KV pools as OrtValues on one device, allocated once and zeroed, with block copies run on that device
    by a helper session (see the module docstring). `device` and `provider` are ONNX Runtime's names."""

    def __init__(
        self,
        names: Sequence[str],
        shape: Sequence[int],
        element_type: int,
        device: str = "cuda",
        provider: str | tuple[str, dict[str, Any]] = CUDA,
        device_id: int = 0,
    ) -> None:
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # keep one node per pool
        self.provider = provider if isinstance(provider, str) else provider[0]
        sessions = [
            ort.InferenceSession(model(len(names), element_type), options, providers=[provider])
            for model in (fill_zeros_model, copy_blocks_model)
        ]
        if any(self.provider not in s.get_providers() for s in sessions):
            raise cuda_unavailable() if self.provider == CUDA else GenerationError(f"{self.provider} did not start")
        self.fill, self.copy = sessions
        self.names, self.shape = list(names), tuple(shape)
        allocation_type = np.float16 if element_type == FLOAT16 else element_type
        self.values = {
            name: ort.OrtValue.ortvalue_from_shape_and_type(self.shape, allocation_type, device, device_id)
            for name in self.names
        }
        self.fill_binding, self.copy_binding = self.fill.io_binding(), self.copy.io_binding()
        for i, value in enumerate(self.values.values()):
            self.fill_binding.bind_ortvalue_output(f"out_{i}", value)
            self.copy_binding.bind_ortvalue_input(f"pool_{i}", value)
            self.copy_binding.bind_ortvalue_output(f"out_{i}", value)
        self.zero()

    @property
    def num_blocks(self) -> int:
        return self.shape[0]

    def zero(self) -> None:
        self.fill_binding.bind_cpu_input("shape", np.array(self.shape, dtype=np.int64))
        self.fill.run_with_iobinding(self.fill_binding)

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy each (source, destination) block of every pool, in order."""
        for block in (b for pair in pairs for b in pair):
            if not 0 <= block < self.num_blocks:
                raise GenerationError(f"copy_blocks: block {block} is outside the pool of {self.num_blocks}")
        for sources, destinations in copy_rounds(pairs):
            self.copy_binding.bind_cpu_input("src", np.array(sources, dtype=np.int64))
            self.copy_binding.bind_cpu_input("dst", np.array(destinations, dtype=np.int64)[:, None])
            self.copy.run_with_iobinding(self.copy_binding)


class OnnxPagedExecutor(Executor):
    kv_layout = KVLayout.PAGED

    def __init__(
        self,
        model: bytes | str,
        max_context: int = 2048,
        num_blocks: int | None = None,
        block_size: int | None = None,
        threads: int = 0,
        optimization: str = "all",
        device_id: int = 0,
    ) -> None:
        provider = (CUDA, {"device_id": device_id})
        require_cuda(provider)
        options = session_options(threads, optimization)
        try:
            self.session = ort.InferenceSession(model, options, providers=[provider, "CPUExecutionProvider"])
        except Exception as exc:  # onnxruntime's own errors (a missing kernel, a bad model), as one type
            raise GenerationError(f"onnxruntime could not load the model on {CUDA}: {exc}") from None
        if self.session.get_providers()[0] != CUDA:
            raise cuda_unavailable()
        pools = [spec for spec in self.session.get_inputs() if cache_layer(spec.name) is not None]
        if not pools or any(not isinstance(d, int) for d in pools[0].shape[1:]):
            raise GenerationError("not a paged-KV-cache model: no k_pool_<layer> inputs with static block shapes")
        _, compiled_block_size, kv_heads, head_dim = pools[0].shape
        if block_size not in (None, compiled_block_size):
            raise GenerationError(f"block_size {block_size}: the model's KV blocks hold {compiled_block_size}")
        if pools[0].type not in POOL_TYPES:
            raise GenerationError(f"KV pools of {pools[0].type}: PagedAttention runs float16 or bfloat16")
        self.block_size, self.max_context = compiled_block_size, max_context
        self.num_blocks = num_blocks or DEFAULT_SEQUENCES * -(-max_context // self.block_size)
        element_type = POOL_TYPES[pools[0].type]
        shape = (self.num_blocks, self.block_size, kv_heads, head_dim)
        self.pools = DevicePools([p.name for p in pools], shape, element_type, provider=provider, device_id=device_id)
        self.input_names = {i.name for i in self.session.get_inputs()}
        self.all_positions = self.session.get_outputs()[0].shape[1] != 1
        self.binding = self.session.io_binding()
        self.binding.bind_output(LOGITS, "cpu")  # bound first: get_outputs()[0]
        for name, value in self.pools.values.items():
            self.binding.bind_ortvalue_input(name, value)
            self.binding.bind_ortvalue_output(PRESENT_PREFIX + name, value)  # the same memory: updated in place

    @classmethod
    def from_artifact(
        cls, artifact: Path, manifest: dict[str, Any], num_blocks: int, block_size: int, max_context: int, threads: int
    ) -> OnnxPagedExecutor:
        layout = manifest.get("kv_layout", {})
        if manifest.get("target") != "cuda" or layout.get("kind") != KVLayout.PAGED.value:
            raise GenerationError(f"{artifact}: not a paged ONNX artifact for CUDA (target {manifest.get('target')})")
        if block_size != layout.get("block_size"):
            raise GenerationError(f"{artifact}: compiled for KV blocks of {layout.get('block_size')}, not {block_size}")
        context = min(max_context, manifest.get("spec", {}).get("max_positions", max_context))  # the rotary rows
        model = str(artifact / manifest["entry_points"]["step"]["file"])
        try:
            return cls(model, context, num_blocks, block_size, threads=threads)
        except GenerationError as exc:
            raise GenerationError(f"{artifact}: {exc}") from None

    def step(self, batch: StepBatch) -> np.ndarray:
        self.check_step(batch)
        packed = pack_batch(batch)
        return last_token_logits(self._run(packed), packed.input_lens, self.kv_layout)

    def prompt_logits(self, tokens: Sequence[int]) -> np.ndarray:
        if not self.all_positions and len(tokens) > 1:
            raise GenerationError("this model computes last-token logits only; compile without last_token_logits")
        batch = StepBatch([tokens], [0], sequential_block_tables(self, [len(tokens)]))
        self.check_step(batch)
        return self._run(pack_batch(batch))[0].astype(np.float32)

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        self.pools.copy_blocks(pairs)

    def _run(self, packed: PackedBatch) -> np.ndarray:
        """Run the model on a packed batch (the pools stay bound); returns its logits on the host."""
        feeds = {
            INPUT_IDS: packed.input_ids,
            POSITION_IDS: packed.position_ids,
            PAST_LENS: packed.past_lens,
            INPUT_LENS: packed.input_lens,
            BLOCK_TABLES: packed.block_tables,
        }
        for name, value in feeds.items():
            if name in self.input_names:
                self.binding.bind_cpu_input(name, np.ascontiguousarray(value))
        self.binding.bind_output(LOGITS, "cpu")  # a fresh array each step
        self.session.run_with_iobinding(self.binding)
        return _host_array(self.binding.get_outputs()[0])


def _host_array(value: ort.OrtValue) -> np.ndarray:
    """A host OrtValue as numpy; bfloat16, which numpy lacks, widened to float32 (its upper 16 bits)."""
    if value.data_type() != "tensor(bfloat16)":
        return value.numpy()
    count = int(np.prod(value.shape()))
    bits = np.frombuffer((ctypes.c_uint16 * count).from_address(value.data_ptr()), np.uint16).reshape(value.shape())
    return (bits.astype(np.uint32) << 16).view(np.float32)
