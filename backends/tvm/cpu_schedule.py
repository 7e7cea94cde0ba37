"""A DLight rule for the CPU: matmuls against a weight stored [N, K] (a linear layer's layout, float or
dequantized inside the kernel), for any number of rows: decode's few and prefill's many.

Schedule: the output columns (weight rows) are split into chunks of `ROWS_PER_CHUNK` that the threads share
(`parallel`); a chunk's weights are dequantized once into a small buffer (`compute_at`) and reused by every
activation row; each dot product runs `LANES` partial sums in vector registers (`rfactor` + `vectorize`)
and adds them up at the end. Elementwise epilogues (bias, cast, residual add) are folded into the write-back.
"""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.s_tir.dlight.analysis import normalize_prim_func
from tvm.s_tir.dlight.cpu.base import CPUScheduleRule
from tvm.target import Target

ROWS_PER_CHUNK = 8
LANES = 8  # one AVX2 float32 vector: ROWS_PER_CHUNK accumulators + x + w fit the 16 vector registers


class WeightRowMatmul(CPUScheduleRule):
    """out[rows..., n] = sum_k x[rows..., k] * w[n, k], with w possibly computed (dequantized) in the function."""

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
        index = infos.index(reductions[0])
        producers = [info.block_rv for info in infos[:index]]
        consumers = [info.block_rv for info in infos[index + 1 :]]

        try:
            return _schedule(sch, block, loops, producers, consumers)
        except s_tir.ScheduleError:
            return None


def _schedule(sch: s_tir.Schedule, block, loops, producers, consumers) -> s_tir.Schedule:
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
        _, lanes = sch.split(sch.get_loops(producer)[-1], [None, LANES])
        sch.vectorize(lanes)
    for consumer in consumers:
        try:
            sch.reverse_compute_inline(consumer)
        except s_tir.ScheduleError:  # e.g. a residual add reading another tensor too: right after each row
            sch.reverse_compute_at(consumer, row)
    return sch
