"""TVM's CPU paged-attention kernel alone: one layer's attention for --streams sequences of --context tokens each,
float32, float16 and int8 pools (made-up values), timed per call over --layers layers' pools in turn (a model's step
reads every layer's cache once, so it comes from memory, not from a cache that a single layer's would fit). --rows 1
(decode): each sequence's last position, with the KV bytes one call reads over its time against this machine's
measured memory bandwidth (llmlower.roofline.ceilings, cached); --rows R > 1: each sequence's last R positions, a
prompt chunk, with the multiply-adds' rate. SmolLM2-135M's attention shape by default.

    .venv/bin/python benchmarks/tvm_attention_kernel.py [--streams 16] [--context 2048] [--rows 1] [--heads 9]
        [--kv-heads 3] [--head-dim 64] [--block-size 16] [--pools float32,float16,int8] [--layers 30] [--repeats 20]
        [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import tvm

from llmlower.backends.tvm.compile import tvm_target
from llmlower.backends.tvm.cpu_schedule import float_lanes
from llmlower.backends.tvm.paged_kernels import attention_kernel
from llmlower.roofline.ceilings import machine_ceilings
from llmlower.runtime.executors.tvm import use_threads


def kernel_inputs(args: argparse.Namespace, pool_dtype: str, seed: int) -> list[tvm.runtime.Tensor]:
    """One layer's inputs: --rows rows per sequence (its last positions), each over its own blocks of a shared pool
    (values and scales made up)."""
    rng = np.random.default_rng(seed)
    blocks_per_sequence = -(-args.context // args.block_size)
    pool_shape = (args.streams * blocks_per_sequence, args.block_size, args.kv_heads, args.head_dim)
    if pool_dtype == "int8":
        k_pool, v_pool = (rng.integers(-127, 128, pool_shape, dtype=np.int8) for _ in range(2))
    else:
        k_pool, v_pool = (rng.standard_normal(pool_shape, dtype=np.float32).astype(pool_dtype) for _ in range(2))
    rows = args.streams * args.rows
    arrays = [
        rng.standard_normal((rows, args.heads, args.head_dim), dtype=np.float32),  # q
        k_pool,
        v_pool,
        np.arange(args.streams * blocks_per_sequence, dtype=np.int32).reshape(args.streams, -1),  # block tables
        np.full(args.streams, args.context - args.rows, dtype=np.int32),  # past lengths: the rows are the last
        np.arange(args.streams + 1, dtype=np.int32) * args.rows,  # query starts
        np.zeros(args.heads, dtype=np.float32),  # sinks (unused)
        np.zeros(args.heads, dtype=np.float32),  # ALiBi slopes (unused)
        np.full((args.kv_heads, args.head_dim), 0.01, dtype=np.float32),  # k_scale (int8 only)
        np.full((args.kv_heads, args.head_dim), 0.01, dtype=np.float32),  # v_scale (int8 only)
        np.empty((rows, args.heads, args.head_dim), dtype=np.float32),  # out
    ]
    return [tvm.runtime.tensor(a) for a in arrays]


def seconds_per_call(args: argparse.Namespace, pool_dtype: str) -> tuple[float, int]:
    """The kernel built for this CPU, its median time per layer over --repeats passes over --layers layers after one
    warm-up pass, and the bytes of one layer's pools."""
    kernel = attention_kernel(
        args.heads,
        args.kv_heads,
        args.head_dim,
        args.block_size,
        "float32",
        args.head_dim**-0.5,
        0,
        "llvm",
        pool_dtype=pool_dtype,
        vector_lanes=float_lanes(tvm_target("cpu")),
    )
    module = tvm.compile(tvm.IRModule({"main": kernel.with_attr("global_symbol", "main")}), target=tvm_target("cpu"))
    layers = [kernel_inputs(args, pool_dtype, seed) for seed in range(args.layers)]
    times = []
    for _ in range(args.repeats + 1):
        start = time.perf_counter()
        for inputs in layers:
            module["main"](*inputs)
        times.append((time.perf_counter() - start) / args.layers)
    times = times[1:]
    element = np.dtype(pool_dtype).itemsize
    return statistics.median(times), 2 * args.streams * args.context * args.kv_heads * args.head_dim * element


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--rows", type=int, default=1, help="query rows per sequence: 1 decodes, more a prompt chunk")
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--pools", default="float32,float16,int8")
    parser.add_argument("--layers", type=int, default=30, help="layers' pools called in turn (SmolLM2 has 30)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    use_threads(args.threads)
    ceilings = machine_ceilings("cpu")
    bandwidth = ceilings.bandwidth
    print(f"{ceilings.description}: {bandwidth / 1e9:.1f} GB/s; {args.threads} TVM threads, median of {args.repeats}")
    for pool_dtype in args.pools.split(","):
        seconds, nbytes = seconds_per_call(args, pool_dtype)
        line = f"{pool_dtype:>8} pools, {args.streams} x {args.context} tokens"
        if args.rows == 1:
            rate = nbytes / seconds
            line += (
                f": {seconds * 1e3:7.3f} ms per layer, {nbytes / 1e6:.1f} MB of KV at {rate / 1e9:.1f} GB/s "
                f"({100 * rate / bandwidth:.0f}% of the bandwidth)"
            )
        else:  # q·k and p·v: two multiply-adds per head, dimension and (row, key) pair of the causal chunk
            pairs = args.streams * sum(args.context - args.rows + 1 + r for r in range(args.rows))
            flops = 4 * pairs * args.heads * args.head_dim
            line += (
                f", the last {args.rows} rows: {seconds * 1e3:7.3f} ms per layer, {flops / seconds / 1e9:.1f} GFLOP/s"
            )
        print(line, flush=True)


if __name__ == "__main__":
    main()
