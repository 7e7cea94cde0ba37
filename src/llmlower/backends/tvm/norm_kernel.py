"""The CPU kernel of `add_rms_norm`: the residual add and the RMSNorm after it in one pass over each row.

TVM's fusion keeps the add (whose sum the next residual add reads too) and the norm's reduction apart, so a layer
ran two kernels, each with its own output allocation and thread-pool launch, twice per layer. Here each row's sum
is written and its squares summed in vector lanes as it is made, then the row is scaled and weighted.
"""

from __future__ import annotations

import functools
import operator

import tvm
from tvm import relax, tirx
from tvm.script import tirx as T

from .cpu_schedule import LANES
from .lane_tree import buffer_tree
from .paged_kernels import ATTRS
from .row_loop import over_rows


def takes(x: relax.Expr, residual: relax.Expr, weight: relax.Expr) -> bool:
    """Whether the kernel takes these: float32 x and residual of one shape [a, b, hidden] (a step's residual
    stream), a float32 weight [hidden], and hidden a multiple of the lanes."""
    shape = x.ty.shape
    if x.ty.ndim != 3 or not all(t.ty.dtype == "float32" for t in (x, residual, weight)):
        return False
    hidden = shape[2]
    analyzer = tvm.sym.Analyzer()
    same = residual.ty.ndim == 3 and all(
        analyzer.can_prove_equal(p, q) for p, q in zip(shape, residual.ty.shape, strict=True)
    )
    return (
        same
        and isinstance(hidden, tirx.IntImm)
        and int(hidden) % LANES == 0
        and weight.ty.ndim == 1
        and isinstance(weight.ty.shape[0], tirx.IntImm)
        and int(weight.ty.shape[0]) == int(hidden)
    )


@functools.cache
def add_rms_norm_kernel(hidden: int, eps: float) -> tirx.PrimFunc:
    """(normed, total) [a, b, hidden] = (rms_norm(x + residual) * weight, x + residual), float32."""

    @T.macro
    def normed_row(i, x, residual, weight, normed, total, b):  # row i of both outputs
        with T.sblock("row"):
            T.reads()
            T.writes()
            squares = T.sblock_alloc_buffer((LANES,), "float32")
            for lane in T.vectorized(LANES):
                squares[lane] = T.float32(0)
            for c in T.serial(hidden // LANES):
                for lane in T.vectorized(LANES):
                    total[i // b, i % b, c * LANES + lane] = (
                        x[i // b, i % b, c * LANES + lane] + residual[i // b, i % b, c * LANES + lane]
                    )
                    squares[lane] += total[i // b, i % b, c * LANES + lane] * total[i // b, i % b, c * LANES + lane]
            inverse: T.let[T.float32] = T.rsqrt(
                buffer_tree(operator.add, squares, (), LANES) / T.float32(hidden) + T.float32(eps)
            )
            for c in T.serial(hidden // LANES):
                for lane in T.vectorized(LANES):
                    normed[i // b, i % b, c * LANES + lane] = (
                        total[i // b, i % b, c * LANES + lane] * inverse * weight[c * LANES + lane]
                    )

    @T.prim_func(s_tir=True, private=True)
    def add_rms_norm(x_h: T.handle, r_h: T.handle, w_h: T.handle, normed_h: T.handle, total_h: T.handle):
        T.func_attr(ATTRS)
        a, b = T.int64(), T.int64()
        x = T.match_buffer(x_h, (a, b, hidden), "float32")
        residual = T.match_buffer(r_h, (a, b, hidden), "float32")
        weight = T.match_buffer(w_h, (hidden,), "float32")
        normed = T.match_buffer(normed_h, (a, b, hidden), "float32")
        total = T.match_buffer(total_h, (a, b, hidden), "float32")
        with T.sblock("root"):
            T.reads()
            T.writes()
            over_rows(a * b, normed_row, (x, residual, weight, normed, total, b))

    return add_rms_norm


def emit_add_rms_norm(
    bb: relax.BlockBuilder, x: relax.Expr, residual: relax.Expr, weight: relax.Expr, eps: float
) -> relax.Expr:
    """(normed, total) as one kernel call, for inputs `takes` accepts."""
    hidden = int(x.ty.shape[2])
    out = relax.TensorType(x.ty.shape, "float32")
    kernel = bb.add_func(add_rms_norm_kernel(hidden, float(eps)), "add_rms_norm")
    both = bb.emit(relax.call_tir(kernel, [x, residual, weight], [out, out]))
    return relax.Tuple([bb.emit(relax.TupleGetItem(both, i)) for i in range(2)])
