"""What bounds a many-stream decode step on ONNX Runtime's CPU EP: its two kernels alone, on SmolLM2-135M's shapes.

- MatMulNBits (the quantized linears): 4- and 8-bit weights, block 32, accuracy level 4 (activations quantized to
  int8, integer dot products: what llmlower's artifacts use) and 0 (weights dequantized to float32), and int8 with
  one scale per output channel as the artifacts run it (`q8c`: activations quantized per row, then ONNX Runtime's
  integer GEMM, MatMulIntegerToFloat), for 1, 16 and 100 rows; time per call and the rate of multiply-adds it
  reaches (GOPS, two per weight and row). A kernel whose rate at 16 rows is already its rate at 100 is bound by
  its arithmetic, not by the weights' bytes.
- GroupQueryAttention decode as the ONNX artifact runs it (one new token per sequence, rotary inside, the cache
  bound as past and present in place) for 1 and 16 sequences at 192 and 2,048 cached tokens: SmolLM2's 9 query heads
  over 3 kv heads, and two controls, 3 over 3 (the same cache, a third of the query heads) and 9 over 9 (three times
  the cache, the same query heads). Time per layer and the cache bytes a layer holds over that time: if the time
  follows the query heads rather than the cache, each query head reads (or copies) its kv head's keys again.

Each case is a one-node model timed alone: the median of --repeats calls after warm-up, --threads intra-op threads.

    .venv/bin/python benchmarks/onnx_cpu_kernels.py [--threads 2] [--repeats 60] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import numpy as np
import onnxruntime as ort
from kv_layouts_onnx_cpu import make_model
from onnx import TensorProto, helper, numpy_helper
from shaped_speed import machine

from llmlower.roofline import machine_ceilings

HEAD_DIM = 64
LINEARS = {
    "q/k/v 576 -> 960": (576, 960),
    "gate/up 576 -> 3072": (576, 3072),
    "down 1536 -> 576": (1536, 576),
    "LM head 576 -> 49152": (576, 49152),
}
KERNELS = ((4, "4"), (4, "0"), (8, "4"), (8, "per channel"))  # (bits, accuracy level or per-channel integer GEMM)
ROWS = (1, 16, 100)
ATTENTION = ((9, 3), (3, 3), (9, 9))  # (query heads, kv heads): SmolLM2's, then the two controls
BATCHES, CONTEXTS = (1, 16), (192, 2048)


def one_graph_session(
    nodes: list[helper.NodeProto], inputs: list, outputs: list, initializers: list, threads: int
) -> ort.InferenceSession:
    """A CPU session of a model holding just `nodes` (kv_layouts_onnx_cpu.make_model's opsets), `threads` intra-op."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    model = make_model(nodes, inputs, outputs, initializers)
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])


def median_seconds(call: Callable[[], object], repeats: int) -> float:
    """The median time of `repeats` calls, after a sixth as many (at least 3) to warm up."""
    for _ in range(max(3, repeats // 6)):
        call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def matmul_nbits(k: int, n: int, bits: int, level: int, threads: int) -> ort.InferenceSession:
    """One MatMulNBits node with random packed weights and scales (block 32, no zero points)."""
    blocks = k // 32
    rng = np.random.default_rng(0)
    weights = rng.integers(0, 256, (n, blocks, 32 * bits // 8), dtype=np.uint8)
    scales = (rng.random(n * blocks) * 0.01).astype(np.float32)
    initializers = [numpy_helper.from_array(weights, "weight"), numpy_helper.from_array(scales, "scales")]
    node = helper.make_node(
        "MatMulNBits", ["a", "weight", "scales"], ["y"], domain="com.microsoft",
        K=k, N=n, bits=bits, block_size=32, accuracy_level=level,
    )  # fmt: skip
    a = helper.make_tensor_value_info("a", TensorProto.FLOAT, ["rows", k])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["rows", n])
    return one_graph_session([node], [a], [y], initializers, threads)


def per_channel_int8(k: int, n: int, threads: int) -> ort.InferenceSession:
    """The ONNX backend's per-channel int8 linear (lowerings._per_channel_int8) on random bytes: x quantized per
    row (uint8 around 128), MatMulIntegerToFloat with the weight's zero point 128 and scales, the row's scale."""
    rng = np.random.default_rng(0)
    arrays = {
        "weight": rng.integers(1, 256, (k, n), dtype=np.uint8),
        "scales": (rng.random(n) * 0.01).astype(np.float32),
        "axis": np.array([-1]),
        "inverse": np.array(1 / 127, np.float32),
        "tiny": np.array(1e-30, np.float32),
        "one": np.array(1.0, np.float32),
        "middle": np.array(128, np.uint8),
    }
    nodes = [
        helper.make_node("Abs", ["a"], ["magnitude"]),
        helper.make_node("ReduceMax", ["magnitude", "axis"], ["peak"], keepdims=1),
        helper.make_node("Mul", ["peak", "inverse"], ["step"]),
        helper.make_node("Max", ["step", "tiny"], ["row_scale"]),
        helper.make_node("Div", ["a", "row_scale"], ["scaled"]),
        helper.make_node("QuantizeLinear", ["scaled", "one", "middle"], ["quantized"]),
        helper.make_node(
            "MatMulIntegerToFloat",
            ["quantized", "weight", "one", "scales", "middle", "middle"],
            ["unscaled"],
            domain="com.microsoft",
        ),  # fmt: skip
        helper.make_node("Mul", ["unscaled", "row_scale"], ["y"]),
    ]
    initializers = [numpy_helper.from_array(value, name) for name, value in arrays.items()]
    a = helper.make_tensor_value_info("a", TensorProto.FLOAT, ["rows", k])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["rows", n])
    return one_graph_session(nodes, [a], [y], initializers, threads)


def measure_matmuls(args: argparse.Namespace) -> list[dict]:
    """Every linear shape x kernel x rows: ms per call and GOPS."""
    rows = []
    for name, (k, n) in LINEARS.items():
        for bits, level in KERNELS:
            if level == "per channel":
                session = per_channel_int8(k, n, args.threads)
            else:
                session = matmul_nbits(k, n, bits, int(level), args.threads)
            for m in ROWS:
                a = np.random.default_rng(1).random((m, k), dtype=np.float32)
                seconds = median_seconds(lambda s=session, a=a: s.run(None, {"a": a}), args.repeats)
                rows.append(dict(linear=name, bits=bits, level=level, rows=m, ms=seconds * 1e3,
                                 gops=2 * m * k * n / seconds / 1e9))  # fmt: skip
    return rows


def decode_attention(
    heads: int, kv_heads: int, batch: int, context: int, threads: int
) -> tuple[Callable[[], object], dict[str, np.ndarray]]:
    """One in-place GroupQueryAttention decode over a [batch, kv_heads, context + 1, 64] cache: the call, and the
    caches it is bound to (keep them alive while calling)."""
    slots = context + 1
    hidden = (heads + 2 * kv_heads) * HEAD_DIM
    cache = [batch, kv_heads, slots, HEAD_DIM]
    inputs = [
        helper.make_tensor_value_info("qkv", TensorProto.FLOAT, [batch, 1, hidden]),
        helper.make_tensor_value_info("past_key", TensorProto.FLOAT, cache),
        helper.make_tensor_value_info("past_value", TensorProto.FLOAT, cache),
        helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [batch]),
        helper.make_tensor_value_info("total_sequence_length", TensorProto.INT32, [1]),
        helper.make_tensor_value_info("cos", TensorProto.FLOAT, [slots, HEAD_DIM // 2]),
        helper.make_tensor_value_info("sin", TensorProto.FLOAT, [slots, HEAD_DIM // 2]),
    ]
    outputs = [
        helper.make_tensor_value_info("out", TensorProto.FLOAT, [batch, 1, heads * HEAD_DIM]),
        helper.make_tensor_value_info("present_key", TensorProto.FLOAT, cache),
        helper.make_tensor_value_info("present_value", TensorProto.FLOAT, cache),
    ]
    node = helper.make_node(
        "GroupQueryAttention",
        ["qkv", "", "", "past_key", "past_value", "seqlens_k", "total_sequence_length", "cos", "sin"],
        ["out", "present_key", "present_value"],
        domain="com.microsoft", num_heads=heads, kv_num_heads=kv_heads, do_rotary=1, scale=HEAD_DIM**-0.5,
    )  # fmt: skip
    session = one_graph_session([node], inputs, outputs, [], threads)
    rng = np.random.default_rng(2)
    arrays = {"qkv": rng.random((batch, 1, hidden), dtype=np.float32)}
    arrays["cos"] = arrays["sin"] = rng.random((slots, HEAD_DIM // 2), dtype=np.float32)
    arrays["seqlens_k"] = np.full(batch, context, np.int32)
    arrays["total_sequence_length"] = np.array([context + 1], np.int32)
    caches = {name: rng.random(cache, dtype=np.float32) for name in ("key", "value")}
    binding = session.io_binding()
    for name, value in arrays.items():
        binding.bind_cpu_input(name, value)
    for name, value in caches.items():  # past and present share the buffer, as the artifact binds them
        binding.bind_input(f"past_{name}", "cpu", 0, np.float32, cache, value.ctypes.data)
        binding.bind_output(f"present_{name}", "cpu", 0, np.float32, cache, value.ctypes.data)
    binding.bind_output("out", "cpu")
    return lambda: session.run_with_iobinding(binding), caches


def measure_attention(args: argparse.Namespace) -> list[dict]:
    """Every batch x context x heads case: ms per layer and the cache's MB over that time."""
    rows = []
    for batch in BATCHES:
        for context in CONTEXTS:
            for heads, kv_heads in ATTENTION:
                call, caches = decode_attention(heads, kv_heads, batch, context, args.threads)
                seconds = median_seconds(call, args.repeats)
                cache_bytes = 2 * batch * kv_heads * context * HEAD_DIM * 4
                rows.append(dict(batch=batch, context=context, heads=heads, kv_heads=kv_heads, ms=seconds * 1e3,
                                 cache_mb=cache_bytes / 1e6, gb_s=cache_bytes / seconds / 1e9))  # fmt: skip
                del caches
    return rows


def print_tables(matmuls: list[dict], attention: list[dict]) -> None:
    print("\n| linear | bits | accuracy level | " + " | ".join(f"{m} rows: ms (GOPS)" for m in ROWS) + " |")
    print("|---|---:|---:|" + "---:|" * len(ROWS))
    for name in LINEARS:
        for bits, level in KERNELS:
            cells = [r for r in matmuls if (r["linear"], r["bits"], r["level"]) == (name, bits, level)]
            timing = " | ".join(f"{r['ms']:.3f} ({r['gops']:.0f})" for r in cells)
            print(f"| {name} | {bits} | {level} | {timing} |")
    print("\n| GroupQueryAttention decode | sequences | cached tokens | ms per layer | cache MB | MB / ms (GB/s) |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in attention:
        label = f"{r['heads']} query heads over {r['kv_heads']} kv heads"
        print(f"| {label} | {r['batch']} | {r['context']} | {r['ms']:.3f} | {r['cache_mb']:.1f} | {r['gb_s']:.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=60)
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()
    host = machine(machine_ceilings())
    print(f"{host}; onnxruntime {ort.__version__}; {args.threads} threads, median of {args.repeats}")
    matmuls, attention = measure_matmuls(args), measure_attention(args)
    print_tables(matmuls, attention)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": host, "matmul_nbits": matmuls, "group_query_attention": attention}, f, indent=1)


if __name__ == "__main__":
    main()
