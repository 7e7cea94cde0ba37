"""The CPU kernel of a quantized linear layer, with each group's scale and zero point applied after its dot product:

    out[i, n] = sum_g scale[n, g] * (sum_{k in g} x[i, k] q[n, k]  -  zero[n, g] sum_{k in g} x[i, k])

Each weight is converted to float32 and multiplied into a partial sum where it is read; the group's scale and zero
point then act once per group on the partial sums (in vector lanes), instead of on every weight ((q - zero) * scale
computed and stored before its dot product). A decode step reads each weight once, so this halves the instructions
per weight there. The threads share chunks of `ROWS` output features (weight rows), whose dot products run side by
side (independent accumulators); 4-bit weights are read a byte at a time, low nibbles against the group's even
features and high nibbles against its odd ones, from a copy of x in that order made once per call.

With an int8 dot product (accuracy_level 4) grouped matmuls take qlinear_int8's kernel instead.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable

import numpy as np
from tvm import relax, tirx
from tvm.script import tirx as T

from .int8_dot import Int8Dot
from .lane_tree import buffer_tree
from .paged_kernels import ATTRS
from .qlinear_int8 import int8_kernel, rounds_activations, zero_layout, zero_point
from .swiglu import Gate

ROWS = 8  # weight rows per task; several activation rows run their dot products side by side (8 accumulators)
# one activation row: weight rows whose dot products run side by side (2 x 4 accumulators: partial sums and
# totals) for 4-bit weights; int8 rows read one at a time, a single stream, ran twice as fast from memory (SmolLM2's
# LM head on Zen 3: 3.0 ms against 5.6-7.0 with 2-8 rows; 4-bit: 2.6 ms with 4 rows, 3.8 with 1)
DECODE_ROWS = {4: 4, 8: 1}


def nibble_order(group: int) -> Callable[[tirx.PrimExpr], tirx.PrimExpr]:
    """The input feature a 4-bit matmul reduces at step k: each group's low nibbles (even features) first, then
    its high ones (odd features), so that consecutive steps read consecutive weight bytes (vector loads)."""
    half = group // 2
    return lambda k: k // group * group + k % half * 2 + k % group // half


def takes(
    x: relax.Expr, scales: relax.Expr, bits: int, group: int, in_features: int, out_features: int, lanes: int
) -> bool:
    """Whether the kernel takes this linear: float32 x, float32 or float16 scales, whole groups of a multiple of the
    lanes (4-bit: of twice the lanes, a byte's two nibbles) and whole chunks of weight rows."""
    per_step = lanes * (2 if bits == 4 else 1)
    return (
        x.ty.dtype == "float32"
        and scales.ty.dtype in ("float32", "float16")
        and in_features % group == 0
        and group % per_step == 0
        and out_features % ROWS == 0
    )


def _weight(byte: tirx.PrimExpr, bits: int) -> tirx.PrimExpr:
    """A byte's 4-bit weight in its low nibble (int8: the byte), as float32."""
    return T.Cast("float32", byte & T.uint8(15) if bits == 4 else byte)


def _high_weight(byte: tirx.PrimExpr) -> tirx.PrimExpr:
    """The 4-bit weight in a byte's high nibble, as float32."""
    return T.Cast("float32", byte >> T.uint8(4))


def _lane_sum(acc: tirx.Buffer, bias_buffer: tirx.Buffer, bias: bool, r: int, n: tirx.PrimExpr, lanes: int):
    """Row r's lanes summed in a tree, plus the bias of output feature n."""
    return buffer_tree(operator.add, acc, (r,), lanes) + (bias_buffer[n] if bias else T.float32(0))


def float_rows_macro(
    out_features: int, in_features: int, group: int, bits: int, zeros: str, bias: bool, lanes: int
) -> Callable:
    """A macro (x, qweight, scales, zero_buffer, bias_buffer, out, rows, b): the float kernel's path for more than
    one row of x, each task's ROWS weight rows dequantized to float32 once, then every row's dot products on FMA."""
    groups = in_features // group
    steps = group * bits // 8 // lanes  # vector steps per group
    half = group // 2
    feature = nibble_order(group) if bits == 4 else (lambda k: k)  # the feature x_order[k] holds

    @T.macro
    def float_rows(x, qweight, scales, zero_buffer, bias_buffer, out, rows, b):
        with T.sblock("float_rows"):
            T.reads()
            T.writes()
            x_order = T.sblock_alloc_buffer((rows, in_features), "float32")
            for i in T.parallel(rows):
                for k in T.serial(in_features):
                    x_order[i, k] = x[i // b, i % b, feature(k)]
            for chunk in T.parallel(out_features // ROWS):
                with T.sblock("rows"):
                    T.reads()
                    T.writes()
                    weight = T.sblock_alloc_buffer((ROWS, in_features), "float32")
                    acc = T.sblock_alloc_buffer((ROWS, lanes), "float32")
                    for r in T.serial(ROWS):
                        for g in T.serial(groups):
                            for c in T.serial(steps):
                                for lane in T.vectorized(lanes):
                                    weight[r, g * group + c * lanes + lane] = (
                                        _weight(qweight[chunk * ROWS + r, g, c * lanes + lane], bits)
                                        - zero_point(zeros, bits, zero_buffer, chunk * ROWS + r, g)
                                    ) * T.Cast("float32", scales[chunk * ROWS + r, g])
                                    if bits == 4:
                                        weight[r, g * group + half + c * lanes + lane] = (
                                            _high_weight(qweight[chunk * ROWS + r, g, c * lanes + lane])
                                            - zero_point(zeros, bits, zero_buffer, chunk * ROWS + r, g)
                                        ) * T.Cast("float32", scales[chunk * ROWS + r, g])
                    for i in T.serial(rows):
                        for r in T.unroll(ROWS):
                            for lane in T.vectorized(lanes):
                                acc[r, lane] = T.float32(0)
                        for k in T.serial(in_features // lanes):
                            for r in T.unroll(ROWS):
                                for lane in T.vectorized(lanes):
                                    acc[r, lane] += x_order[i, k * lanes + lane] * weight[r, k * lanes + lane]
                        for r in T.unroll(ROWS):
                            out[i // b, i % b, chunk * ROWS + r] = _lane_sum(
                                acc, bias_buffer, bias, r, chunk * ROWS + r, lanes
                            )

    return float_rows


@functools.cache
def qlinear_kernel(
    out_features: int,
    in_features: int,
    group: int,
    bits: int,
    zeros: str,
    bias: bool,
    lanes: int,
    int8_dot: Int8Dot | None = None,
    scale_dtype: str = "float32",
) -> tirx.PrimFunc:
    """out [a, b, N] = x [a, b, K] @ dequantize(w).T (+ bias): qweight uint8 [N, groups, bytes per group], scales
    [N, groups] in `scale_dtype` (float32 or float16), `zeros` "none" (symmetric: 8, or 128 for int8), "float"
    ([N, groups], the scales' dtype) or "nibbles" (uint8 [N, ceil(groups / 2)]); absent zeros and bias are passed as
    a one-element placeholder the kernel never reads. With `int8_dot`, the matmuls that `rounds_activations` takes
    (per-channel ones too: x rounded a row at a time) are qlinear_int8's int8 kernel."""
    groups = in_features // group
    if rounds_activations(bits, group, int8_dot):
        return int8_kernel(out_features, in_features, group, bits, zeros, bias, int8_dot, scale_dtype)
    float_rows = float_rows_macro(out_features, in_features, group, bits, zeros, bias, lanes)
    per_group = group * bits // 8  # bytes
    steps = per_group // lanes  # vector steps per group
    half = group // 2
    decode_rows = DECODE_ROWS[bits]
    zero_shape, zero_dtype = zero_layout(zeros, out_features, groups, scale_dtype)
    feature = nibble_order(group) if bits == 4 else (lambda k: k)  # the feature x_order[k] holds

    @T.prim_func(s_tir=True, private=True)
    def qlinear(x_h: T.handle, w_h: T.handle, s_h: T.handle, z_h: T.handle, b_h: T.handle, out_h: T.handle):
        T.func_attr(ATTRS)
        a, b = T.int64(), T.int64()
        x = T.match_buffer(x_h, (a, b, in_features), "float32")
        qweight = T.match_buffer(w_h, (out_features, groups, per_group), "uint8")
        scales = T.match_buffer(s_h, (out_features, groups), scale_dtype)
        zero_buffer = T.match_buffer(z_h, zero_shape, zero_dtype)
        bias_buffer = T.match_buffer(b_h, (out_features if bias else 1,), "float32")
        out = T.match_buffer(out_h, (a, b, out_features), "float32")
        with T.sblock("root"):
            T.reads()
            T.writes()
            if a * b == 1:  # decode: each weight read once, scaled per group
                with T.sblock("decode"):
                    T.reads()
                    T.writes()
                    x_order = T.sblock_alloc_buffer((in_features,), "float32")
                    for k in T.serial(in_features):
                        x_order[k] = x[0, 0, feature(k)]
                    for chunk in T.parallel(out_features // ROWS):
                        with T.sblock("row"):  # its buffers made once per chunk (each is a call into TVM)
                            T.reads()
                            T.writes()
                            acc = T.sblock_alloc_buffer((decode_rows, lanes), "float32")
                            part = T.sblock_alloc_buffer((decode_rows, lanes), "float32")
                            x_sum = T.sblock_alloc_buffer((lanes,), "float32")
                            for rows in T.serial(ROWS // decode_rows):
                                first: T.let[T.int32] = chunk * ROWS + rows * decode_rows
                                for r in T.unroll(decode_rows):
                                    for lane in T.vectorized(lanes):
                                        acc[r, lane] = T.float32(0)
                                for g in T.serial(groups):
                                    for lane in T.vectorized(lanes):
                                        x_sum[lane] = T.float32(0)
                                    for r in T.unroll(decode_rows):
                                        for lane in T.vectorized(lanes):
                                            part[r, lane] = T.float32(0)
                                    for c in T.unroll(steps):
                                        for lane in T.vectorized(lanes):
                                            x_sum[lane] += x_order[g * group + c * lanes + lane]
                                            if bits == 4:
                                                x_sum[lane] += x_order[g * group + half + c * lanes + lane]
                                        for r in T.unroll(decode_rows):
                                            for lane in T.vectorized(lanes):
                                                part[r, lane] += x_order[g * group + c * lanes + lane] * _weight(
                                                    qweight[first + r, g, c * lanes + lane], bits
                                                )
                                                if bits == 4:
                                                    part[r, lane] += x_order[
                                                        g * group + half + c * lanes + lane
                                                    ] * _high_weight(qweight[first + r, g, c * lanes + lane])
                                    for r in T.unroll(decode_rows):
                                        for lane in T.vectorized(lanes):
                                            acc[r, lane] += T.Cast("float32", scales[first + r, g]) * (
                                                part[r, lane]
                                                - zero_point(zeros, bits, zero_buffer, first + r, g) * x_sum[lane]
                                            )
                                for r in T.unroll(decode_rows):
                                    out[0, 0, first + r] = _lane_sum(acc, bias_buffer, bias, r, first + r, lanes)
            else:  # several rows: each task's weights dequantized once, then every row's dot products
                float_rows(x, qweight, scales, zero_buffer, bias_buffer, out, a * b, b)

    return qlinear


def _zero_kind(zeros: relax.Expr | None) -> str:
    """The kernels' `zeros` argument for this zero-point operand."""
    return "none" if zeros is None else "nibbles" if zeros.ty.dtype == "uint8" else "float"


def _weight_operands(
    bb: relax.BlockBuilder, scales: relax.Expr, zeros: relax.Expr | None, bias: relax.Expr | None
) -> list[relax.Expr]:
    """The kernels' scales, zero-point and bias operands: absent ones a placeholder they never read, the bias in
    float32."""
    placeholder = relax.const(np.zeros(1, "float32"))
    bias = bb.emit(relax.op.astype(bias, "float32")) if bias is not None else placeholder
    return [scales, zeros if zeros is not None else placeholder, bias]


def emit_qlinear(
    bb: relax.BlockBuilder,
    x: relax.Expr,
    qweight: relax.Expr,
    scales: relax.Expr,
    zeros: relax.Expr | None,
    bias: relax.Expr | None,
    bits: int,
    in_features: int,
    lanes: int,
    int8_dot: Int8Dot | None = None,
) -> relax.Expr:
    """x [..., K] @ dequantize(w).T (+ bias) through the kernel, which takes x in three dims (a step's [1, tokens,
    K], or the LM head's [sequences, 1, K]); other ranks are reshaped to [1, rows, K] and back."""
    out_features = int(qweight.ty.shape[0])
    group = int(qweight.ty.shape[2]) * 8 // bits
    zero_kind = _zero_kind(zeros)
    kernel = qlinear_kernel(
        out_features, in_features, group, bits, zero_kind, bias is not None, lanes, int8_dot, scales.ty.dtype
    )
    *lead, _ = x.ty.shape
    rows = x if len(lead) == 2 else bb.emit(relax.op.reshape(x, [1, -1, in_features]))
    args = [rows, qweight, *_weight_operands(bb, scales, zeros, bias)]
    out = bb.emit(
        relax.call_tir(
            bb.add_func(kernel, "qlinear_groups"),
            args,
            relax.TensorType([rows.ty.shape[0], rows.ty.shape[1], out_features], "float32"),
        )
    )
    return out if len(lead) == 2 else bb.emit(relax.op.reshape(out, [*lead, out_features]))


_experts_kernel = functools.cache(int8_kernel)  # its MoE form, one per shape and scheme (emit_qlinear_experts)


def experts_take(
    x: relax.Expr, qweight: relax.Expr, scales: relax.Expr, bits: int, in_features: int, int8_dot: Int8Dot | None
) -> bool:
    """Whether a MoE layer's matmul of x by these packed experts takes the int8 kernel: float32 x, float32 or float16
    scales, whole groups that the int8 path rounds."""
    group = int(qweight.ty.shape[-1]) * 8 // bits
    return (
        x.ty.dtype == "float32"
        and scales.ty.dtype in ("float32", "float16")
        and in_features % group == 0
        and rounds_activations(bits, group, int8_dot)
    )


def emit_qlinear_experts(
    bb: relax.BlockBuilder,
    x: relax.Expr,
    ids: relax.Expr,
    qweight: relax.Expr,
    scales: relax.Expr,
    zeros: relax.Expr | None,
    bias: relax.Expr | None,
    bits: int,
    in_features: int,
    int8_dot: Int8Dot,
    gate: Gate | None = None,
) -> relax.Expr:
    """x times the router's chosen experts (+ bias) through the int8 kernel: x [T, K] (up: a token's row for each of
    its experts) or [T, top_k, K] (down: a row each; with `gate`, the up matmul's interleaved gate/up rows
    [T, top_k, 2K], which the kernel turns into K features by swiglu.swiglu) -> [T, top_k, N] float32. Each
    expert's packed weights [E, N, groups, bytes] are read at the pair's expert only."""
    experts, out_features, _, per_group = (int(d) for d in qweight.ty.shape)
    shared_x = len(x.ty.shape) == 2
    scheme = (out_features, in_features, per_group * 8 // bits, bits, _zero_kind(zeros), bias is not None)
    kernel = _experts_kernel(*scheme, int8_dot, scales.ty.dtype, experts=experts, shared_x=shared_x, gate=gate)
    rows = x if shared_x else bb.emit(relax.op.reshape(x, [-1, int(x.ty.shape[-1])]))
    ids = ids if ids.ty.dtype == "int64" else bb.emit(relax.op.astype(ids, "int64"))
    args = [rows, ids, qweight, *_weight_operands(bb, scales, zeros, bias)]
    tokens, top_k = ids.ty.shape
    out_type = relax.TensorType([tokens, top_k, out_features], "float32")
    return bb.emit(relax.call_tir(bb.add_func(kernel, "qlinear_experts"), args, out_type))
