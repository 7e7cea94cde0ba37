"""The CPU kernel of `silu_mul` (SwiGLU's gate): out = silu(gate) * up over the two halves of each row, with exp in
vector lanes (paged_kernels.vector_exp). TVM's own silu calls libm's scalar expf for every element, which made the op
a twentieth of a 16-stream decode step at 1B (10 of 171 ms); here a row is one pass of vector arithmetic."""

from __future__ import annotations

import functools

from tvm import relax, tirx
from tvm.script import tirx as T

from .cpu_schedule import LANES
from .paged_kernels import ATTRS, vector_exp
from .row_loop import over_rows


def takes(x: relax.Expr) -> bool:
    """Whether the kernel takes x: float32 [a, b, 2 * width] with a static width that is a multiple of the lanes."""
    if x.ty.ndim != 3 or x.ty.dtype != "float32" or not isinstance(x.ty.shape[2], tirx.IntImm):
        return False
    return int(x.ty.shape[2]) % (2 * LANES) == 0


@functools.cache
def silu_mul_kernel(width: int) -> tirx.PrimFunc:
    """out [a, b, width] = silu(x[..., :width]) * x[..., width:] for x [a, b, 2 * width], float32."""

    @T.macro
    def gated_row(i, x, out, b):  # row i of out
        for c in T.serial(width // LANES):
            for lane in T.vectorized(LANES):
                out[i // b, i % b, c * LANES + lane] = (
                    x[i // b, i % b, c * LANES + lane]
                    / (T.float32(1) + vector_exp(-x[i // b, i % b, c * LANES + lane]))
                    * x[i // b, i % b, width + c * LANES + lane]
                )

    @T.prim_func(s_tir=True, private=True)
    def silu_mul(x_h: T.handle, out_h: T.handle):
        T.func_attr(ATTRS)
        a, b = T.int64(), T.int64()
        x = T.match_buffer(x_h, (a, b, 2 * width), "float32")
        out = T.match_buffer(out_h, (a, b, width), "float32")
        with T.sblock("root"):
            T.reads()
            T.writes()
            over_rows(a * b, gated_row, (x, out, b))

    return silu_mul


def emit_silu_mul(bb: relax.BlockBuilder, x: relax.Expr) -> relax.Expr:
    """silu_mul as one kernel call, for an x `takes` accepts."""
    width = int(x.ty.shape[2]) // 2
    kernel = bb.add_func(silu_mul_kernel(width), "silu_mul")
    out = relax.TensorType([x.ty.shape[0], x.ty.shape[1], width], "float32")
    return bb.emit(relax.call_tir(kernel, [x], out))
