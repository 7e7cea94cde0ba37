"""x rounded to int8 per group of features, as both int8 kernels round it (qlinear_int8's vectors, qlinear_amx's
tiles): each group's scale is max|x| / 127, and a value rounds to the nearest integer of x * 127 / max|x| (ties to
even), so the two paths multiply the same integers."""

from __future__ import annotations

import math

from tvm import tirx
from tvm.script import tirx as T

from .lane_tree import buffer_tree


def group_max_macro(group: int):
    """A macro group_max(k, i, b, g, largest): largest[0] = max |x| over group g of row i of x [a, b, K], in vector
    lanes (a running maximum in memory would wait on each store); `largest` is the caller's local (a buffer shared
    by rows would bounce between the threads that round them)."""
    lanes = math.gcd(group, 16)

    @T.macro
    def group_max(k, i, b, g, largest):
        with T.sblock("group_max"):
            T.reads()
            T.writes()
            lane_max = T.sblock_alloc_buffer((lanes,), "float32")
            for lane in T.vectorized(lanes):
                lane_max[lane] = T.float32(0)
            for j in T.serial(group // lanes):
                for lane in T.vectorized(lanes):
                    lane_max[lane] = T.max(lane_max[lane], T.fabs(k.x[i // b, i % b, g * group + j * lanes + lane]))
            largest[0] = buffer_tree(T.max, lane_max, (), lanes)

    return group_max


def inverse_scale(x_max: tirx.PrimExpr) -> tirx.PrimExpr:
    """127 / max|x|: what x is multiplied by before rounding; 0 for a group of zeros (no division)."""
    return T.if_then_else(x_max > T.float32(0), T.float32(127) / x_max, T.float32(0))
