"""TVM's CPU paged-attention kernel alone: one layer's decode attention for --streams sequences of --context cached
tokens each, float32 and int8 pools (made-up values), timed per call; the KV bytes one call reads over its time,
against this machine's measured memory bandwidth (llmlower.roofline.ceilings, cached). SmolLM2-135M's attention
shape by default.

    .venv/bin/python benchmarks/tvm_attention_kernel.py [--streams 16] [--context 2048] [--heads 9] [--kv-heads 3]
        [--head-dim 64] [--block-size 16] [--pools float32,int8] [--repeats 20] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import tvm

from llmlower.backends.tvm.compile import tvm_target
from llmlower.backends.tvm.paged_kernels import attention_kernel
from llmlower.roofline.ceilings import machine_ceilings
from llmlower.runtime.executors.tvm import use_threads


def kernel_inputs(args: argparse.Namespace, pool_dtype: str) -> list[tvm.runtime.Tensor]:
    """One decode row per sequence, each over its own blocks of a shared pool (values and scales made up)."""
    rng = np.random.default_rng(0)
    blocks_per_sequence = -(-args.context // args.block_size)
    pool_shape = (args.streams * blocks_per_sequence, args.block_size, args.kv_heads, args.head_dim)
    if pool_dtype == "int8":
        k_pool, v_pool = (rng.integers(-127, 128, pool_shape, dtype=np.int8) for _ in range(2))
    else:
        k_pool, v_pool = (rng.standard_normal(pool_shape, dtype=np.float32) for _ in range(2))
    arrays = [
        rng.standard_normal((args.streams, args.heads, args.head_dim), dtype=np.float32),  # q
        k_pool,
        v_pool,
        np.arange(args.streams * blocks_per_sequence, dtype=np.int32).reshape(args.streams, -1),  # block tables
        np.full(args.streams, args.context - 1, dtype=np.int32),  # past lengths: the row is the last position
        np.arange(args.streams + 1, dtype=np.int32),  # query starts: one row each
        np.zeros(args.heads, dtype=np.float32),  # sinks (unused)
        np.zeros(args.heads, dtype=np.float32),  # ALiBi slopes (unused)
        np.full((args.kv_heads, args.head_dim), 0.01, dtype=np.float32),  # k_scale (int8 only)
        np.full((args.kv_heads, args.head_dim), 0.01, dtype=np.float32),  # v_scale (int8 only)
        np.empty((args.streams, args.heads, args.head_dim), dtype=np.float32),  # out
    ]
    return [tvm.runtime.tensor(a) for a in arrays]


def seconds_per_call(args: argparse.Namespace, pool_dtype: str) -> tuple[float, int]:
    """The kernel built for this CPU, its median time over --repeats calls after three warm-ups, and the bytes of
    the pools it reads."""
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
    )
    module = tvm.compile(tvm.IRModule({"main": kernel.with_attr("global_symbol", "main")}), target=tvm_target("cpu"))
    inputs = kernel_inputs(args, pool_dtype)
    for _ in range(3):
        module["main"](*inputs)
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        module["main"](*inputs)
        times.append(time.perf_counter() - start)
    element = np.dtype(pool_dtype).itemsize
    return statistics.median(times), 2 * args.streams * args.context * args.kv_heads * args.head_dim * element


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--pools", default="float32,int8")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    use_threads(args.threads)
    ceilings = machine_ceilings("cpu")
    bandwidth = ceilings.bandwidth
    print(f"{ceilings.description}: {bandwidth / 1e9:.1f} GB/s; {args.threads} TVM threads, median of {args.repeats}")
    for pool_dtype in args.pools.split(","):
        seconds, nbytes = seconds_per_call(args, pool_dtype)
        rate = nbytes / seconds
        print(
            f"{pool_dtype:>8} pools, {args.streams} x {args.context} tokens: {seconds * 1e3:7.3f} ms per layer, "
            f"{nbytes / 1e6:.1f} MB of KV at {rate / 1e9:.1f} GB/s ({100 * rate / bandwidth:.0f}% of the bandwidth)",
            flush=True,
        )


if __name__ == "__main__":
    main()
