"""A DLight rule for the CPU: matmuls against a weight stored [N, K] (a linear layer's layout, float or
dequantized inside the kernel), for any number of rows: decode's few and prefill's many. The MoE experts' matmuls
take it too: out[t, j, n] = sum_k x[t, (j,) k] * w(ids[t, j], n, k), each row's weight the expert the router
chose, read (and dequantized) inside the reduction.

Schedule: the output columns (weight rows) are split into chunks of `ROWS_PER_CHUNK` that the threads share
(`parallel`); a chunk's weights are dequantized once into a small buffer (`compute_at`) and reused by every
activation row (in the target's widest vectors: 16 float32 lanes with AVX-512, else `LANES`); each dot product
runs `LANES` partial sums in vector registers (`rfactor` + `vectorize`) and adds them up at the end. Producers
the matmul reads at the activation's rows only (a reordering of x) stay whole, computed once. Elementwise
epilogues (bias, cast, residual add) are folded into the write-back, those that read the matmul's output and
otherwise only the function's inputs: an epilogue that also reads a tensor computed in the function outside the
chunks stays after the loops (see `_reads_only_folded`). The experts' weights have no dequantize
producer: one computed per chunk would cover every expert (its expert index is data-dependent), so they are
dequantized where the vectorized partial sums read them, and a step reads the chosen experts' rows only.
"""

from __future__ import annotations

import tvm
from tvm import s_tir, tirx
from tvm.s_tir.dlight.analysis import normalize_prim_func
from tvm.s_tir.dlight.cpu.base import CPUScheduleRule
from tvm.target import Target

ROWS_PER_CHUNK = 8
LANES = 8  # one AVX2 float32 vector: ROWS_PER_CHUNK accumulators + x + w fit the 16 vector registers
AVX512_LANES = 16  # for the dequantize loops (16-lane dot products measured slower in prefill on Zen 4)


class WeightRowMatmul(CPUScheduleRule):
    """out[rows..., n] = sum_k x[rows..., k] * w[n, k], with w possibly computed (dequantized) in the function or
    read at an expert chosen per row."""

    def apply(self, func: tirx.PrimFunc, target: Target, _: bool) -> s_tir.Schedule | None:
        if not isinstance(func, tirx.PrimFunc) or not self.is_target_available(target):
            return None
        sch = s_tir.Schedule(func)
        infos = normalize_prim_func(sch)
        if infos is None:
            return None
        reductions = [info for info in infos if info.is_reduction()]
        if len(reductions) != 1 or not all(info.is_injective() for info in infos if info not in reductions):
            return None
        block = reductions[0].block_rv
        loops = sch.get_loops(block)
        kinds = [iter_info.kind for iter_info in reductions[0].iters]
        if len(loops) < 2 or kinds[-1] != "R" or "R" in kinds[:-1] or kinds[-2] != "S":
            return None
        reduce_extent = reductions[0].iters[-1].dom
        if not isinstance(reduce_extent, tirx.IntImm | int) or int(reduce_extent) % LANES:
            return None
        unpack_lanes = dequantize_lanes(target, int(reduce_extent))
        index = infos.index(reductions[0])
        producers = [info.block_rv for info in infos[:index] if _read_per_column(sch, block, info.block_rv)]
        consumers = [info.block_rv for info in infos[index + 1 :]]

        try:
            return _schedule(sch, block, loops, producers, consumers, unpack_lanes)
        except s_tir.ScheduleError:
            return None


def float_lanes(target: Target) -> int:
    """float32 lanes of the target CPU's widest vectors: AVX512_LANES with AVX-512, else LANES."""
    features = {str(f) for f in tvm.target.codegen.llvm_get_cpu_features(target)}
    return AVX512_LANES if "avx512f" in features else LANES


def dequantize_lanes(target: Target, width: int) -> int:
    """float32 lanes of the dequantize loops over `width` weights: 16 with AVX-512 (one 16-byte load of 4-bit
    weights unpacks into two registers: decode's q4 matmuls twice as fast as with 8) where they divide it,
    else LANES."""
    lanes = float_lanes(target)
    return lanes if width % lanes == 0 else LANES


def _schedule(sch: s_tir.Schedule, block, loops, producers, consumers, unpack_lanes: int) -> s_tir.Schedule:
    *rows, column, k = loops
    chunk, column = sch.split(column, [None, ROWS_PER_CHUNK])
    k_outer, lane = sch.split(k, [None, LANES])
    sch.reorder(chunk, *rows, k_outer, column, lane)  # one x vector, then a chunk's weight rows against it
    sch.parallel(chunk)
    output_rank = len(sch.get(block).writes[0].region)
    partial = sch.rfactor(lane, factor_axis=output_rank)  # per (row, column): LANES partial sums
    partial_loops = sch.get_loops(partial)  # chunk, rows..., k_outer, column, lane, as ordered above
    sch.vectorize(partial_loops[-1])
    sch.unroll(partial_loops[-2])  # ROWS_PER_CHUNK independent accumulators
    row = partial_loops[-4] if rows else partial_loops[0]
    sch.reverse_compute_at(block, row)  # add the lanes up once a row's dot products are done
    for producer in reversed(producers):  # dequantize a chunk of weight rows once, for all activation rows
        sch.compute_at(producer, partial_loops[0])
        _, vector = sch.split(sch.get_loops(producer)[-1], [None, unpack_lanes])
        sch.vectorize(vector)
    folded = [sch.get(block).writes[0].source]  # what the chunk's rows hold once their dot products are done
    made_here = [sch.get(b).writes[0].source for b in (*producers, *consumers)]
    for consumer in consumers:
        if not _reads_only_folded(sch.get(consumer), folded, made_here):
            continue  # stays after the matmul's loops, computed once over every row
        written = sch.get(consumer).writes[0].source
        try:
            sch.reverse_compute_inline(consumer)
        except (s_tir.ScheduleError, tvm.error.InternalError):
            # e.g. a residual add reading another tensor too: right after each row (TVM 0.27 raises an
            # InternalError, not a ScheduleError, for some: a norm's (x - mean) * rsqrt, x - mean an input)
            sch.reverse_compute_at(consumer, row)
        folded.append(written)
    return sch


def _reads_only_folded(consumer: s_tir.SBlock, folded: list, made_here: list) -> bool:
    """Whether an epilogue may be folded into the matmul's chunk loops: it reads the matmul's output (or an
    epilogue folded before it) and no other tensor computed in the function. One that reads such a tensor, made
    outside the chunks (x - mean beside a norm's rsqrt), would be computed per chunk over every row, reading
    rows that other threads' chunks have not written yet."""
    reads = [region.source for region in consumer.reads]
    from_matmul = any(any(buffer.same_as(f) for f in folded) for buffer in reads)
    other = [buffer for buffer in reads if not any(buffer.same_as(f) for f in folded)]
    return from_matmul and not any(buffer.same_as(m) for buffer in other for m in made_here)


def _read_per_column(sch: s_tir.Schedule, block, producer) -> bool:
    """Whether the matmul reads the producer's output at its output column (a weight row) rather than only
    at the activation's rows and the reduction."""
    matmul = sch.get(block)
    column = matmul.iter_vars[-2].var
    written = sch.get(producer).writes[0].source
    return any(
        var.same_as(column)
        for region in matmul.reads
        if region.source.same_as(written)
        for bounds in region.region
        for var in tirx.analysis.undefined_vars(bounds.min)
    )
