"""The CPU kernel of a quantized linear layer, with each group's scale and zero point applied after its dot product:

    out[i, n] = sum_g scale[n, g] * (sum_{k in g} x[i, k] q[n, k]  -  zero[n, g] sum_{k in g} x[i, k])

Each weight is converted to float32 and multiplied into a partial sum where it is read; the group's scale and zero
point then act once per group on the partial sums (in vector lanes), instead of on every weight ((q - zero) * scale
computed and stored before its dot product). A decode step reads each weight once, so this halves the instructions
per weight there. The threads share chunks of `ROWS` output features (weight rows), whose dot products run side by
side (independent accumulators); 4-bit weights are read a byte at a time, low nibbles against the group's even
features and high nibbles against its odd ones, from a copy of x in that order made once per call.

With `int8_dot` (accuracy_level 4), one activation row's matmul runs in int8 instead where `rounds_activations`
says so: x is rounded to int8 per group (scale max|x| / 127), each weight row is read on its own by one thread (a
single stream) and multiplied 16 bytes at a time by int8_dot's instruction, and each group adds
scale * x_scale * (dot - zero * the sum of x's integers). Converting each weight to float32 bound the float kernel
by its instructions; this one is bound by memory.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
from tvm import relax, tirx
from tvm.script import tirx as T

from .int8_dot import VNNI, dot_u8_s8
from .paged_kernels import ATTRS

ROWS = 8  # weight rows per task; several activation rows run their dot products side by side (8 accumulators)
# one activation row: weight rows whose dot products run side by side (2 x 4 accumulators: partial sums and
# totals) for 4-bit weights; int8 rows read one at a time, a single stream, ran twice as fast from memory (SmolLM2's
# LM head on Zen 3: 3.0 ms against 5.6-7.0 with 2-8 rows; 4-bit: 2.6 ms with 4 rows, 3.8 with 1)
DECODE_ROWS = {4: 4, 8: 1}
INT8_BYTES = 16  # int8: weight bytes per instruction


def nibble_order(group: int) -> Callable[[tirx.PrimExpr], tirx.PrimExpr]:
    """The input feature a 4-bit matmul reduces at step k: each group's low nibbles (even features) first, then
    its high ones (odd features), so that consecutive steps read consecutive weight bytes (vector loads)."""
    half = group // 2
    return lambda k: k // group * group + k % half * 2 + k % group // half


def takes(
    x: relax.Expr, scales: relax.Expr, bits: int, group: int, in_features: int, out_features: int, lanes: int
) -> bool:
    """Whether the kernel takes this linear: float32 x and scales, whole groups of a multiple of the lanes (4-bit: of
    twice the lanes, a byte's two nibbles) and whole chunks of weight rows."""
    per_step = lanes * (2 if bits == 4 else 1)
    return (
        x.ty.dtype == "float32"
        and scales.ty.dtype == "float32"
        and in_features % group == 0
        and group % per_step == 0
        and out_features % ROWS == 0
    )


def rounds_activations(bits: int, group: int, groups: int, int8_dot: str | None) -> bool:
    """Whether one activation row's matmul runs in int8 (x rounded per group, `int8_dot`'s instruction): groups of
    whole 16-byte vectors of weights, on a CPU with such an instruction; 8-bit weights only with VNNI (pmaddubsw's
    int16 pair sums would saturate) and not per channel (one group a row: one chain of dependent instructions)."""
    if int8_dot is None or group * bits // 8 % INT8_BYTES or groups == 1:
        return False
    return bits == 4 or int8_dot == VNNI


@functools.cache
def qlinear_kernel(
    out_features: int,
    in_features: int,
    group: int,
    bits: int,
    zeros: str,
    bias: bool,
    lanes: int,
    int8_dot: str | None = None,
) -> tirx.PrimFunc:
    """out [a, b, N] = x [a, b, K] @ dequantize(w).T (+ bias): qweight uint8 [N, groups, bytes per group], scales
    float32 [N, groups], `zeros` "none" (symmetric: 8, or 128 for int8), "float" (float32 [N, groups]) or "nibbles"
    (uint8 [N, ceil(groups / 2)]); absent zeros and bias are passed as a one-element placeholder the kernel never
    reads. `int8_dot` (int8_dot.VNNI or MADDUBS): one activation row's matmul in int8 (`rounds_activations`)."""
    groups = in_features // group
    int8_row = rounds_activations(bits, group, groups, int8_dot)
    unroll = next(u for u in (4, 2, 1) if groups % u == 0)  # int8: groups whose dot products run side by side
    task_rows = next(r for r in (64, 32, 16, ROWS) if out_features % r == 0)  # int8: rows a thread takes at once
    per_group = group * bits // 8  # bytes
    steps = per_group // lanes  # vector steps per group
    half = group // 2
    decode_rows = DECODE_ROWS[bits]
    zero_shape = {"none": (1,), "float": (out_features, groups), "nibbles": (out_features, (groups + 1) // 2)}[zeros]
    zero_dtype = "uint8" if zeros == "nibbles" else "float32"
    symmetric_zero = float(2 ** (bits - 1))

    def zero_of(zero_buffer, n, g):
        if zeros == "float":
            return zero_buffer[n, g]
        if zeros == "nibbles":
            return T.Cast("float32", (zero_buffer[n, g // 2] >> T.Cast("uint8", g % 2 * 4)) & T.uint8(15))
        return T.float32(symmetric_zero)

    def low(byte):  # a byte's 4-bit weight in its low nibble (int8: the byte), as float32
        return T.Cast("float32", byte & T.uint8(15) if bits == 4 else byte)

    def high(byte):  # the 4-bit weight in its high nibble
        return T.Cast("float32", byte >> T.uint8(4))

    def dot(acc, bias_buffer, rows, width, n):  # the accumulators' rows and `width` lanes summed, plus the bias
        total = bias_buffer[n] if bias else T.float32(0)
        for r in rows:
            for lane in range(width):
                total = total + acc[r, lane]
        return total

    def rounded_x(x_even, x_odd, byte):  # int8: the rounded x a weight byte multiplies (4-bit: both nibbles'), summed
        if bits == 4:
            return T.Cast("float32", x_even[byte]) + T.Cast("float32", x_odd[byte])
        return T.Cast("float32", x_even[byte])

    def weight_dot(acc, weights, x_even, x_odd, at):  # int8: acc + 16 weight bytes against the rounded x from `at`
        if bits == 8:
            return dot_u8_s8(int8_dot, acc, weights, x_even[T.ramp(at, 1, INT8_BYTES)])
        low_nibbles = dot_u8_s8(
            int8_dot, acc, weights & T.broadcast(T.uint8(15), INT8_BYTES), x_even[T.ramp(at, 1, INT8_BYTES)]
        )
        return dot_u8_s8(
            int8_dot, low_nibbles, weights >> T.broadcast(T.uint8(4), INT8_BYTES), x_odd[T.ramp(at, 1, INT8_BYTES)]
        )

    feature = nibble_order(group) if bits == 4 else (lambda k: k)  # the feature x_order[k] holds

    @T.prim_func(s_tir=True, private=True)
    def qlinear(x_h: T.handle, w_h: T.handle, s_h: T.handle, z_h: T.handle, b_h: T.handle, out_h: T.handle):
        T.func_attr(ATTRS)
        a, b = T.int64(), T.int64()
        x = T.match_buffer(x_h, (a, b, in_features), "float32")
        qweight = T.match_buffer(w_h, (out_features, groups, per_group), "uint8")
        scales = T.match_buffer(s_h, (out_features, groups), "float32")
        zero_buffer = T.match_buffer(z_h, zero_shape, zero_dtype)
        bias_buffer = T.match_buffer(b_h, (out_features if bias else 1,), "float32")
        out = T.match_buffer(out_h, (a, b, out_features), "float32")
        with T.sblock("root"):
            T.reads()
            T.writes()
            x_order = T.sblock_alloc_buffer((a * b, in_features), "float32")
            x_even = T.sblock_alloc_buffer((in_features,), "int8")  # int8: x rounded (4-bit: its even features)
            x_odd = T.sblock_alloc_buffer((in_features // 2,), "int8")  # 4-bit: the odd features
            x_scale = T.sblock_alloc_buffer((groups,), "float32")
            x_sums = T.sblock_alloc_buffer((groups, 4), "float32")  # the rounded x each int32 lane multiplies
            x_max = T.sblock_alloc_buffer((1,), "float32")
            if int8_row and a * b == 1:
                for g in T.serial(groups):  # round x to int8 per group, scale max |x| / 127
                    x_max[0] = T.float32(0)
                    for k in T.serial(group):
                        x_max[0] = T.max(x_max[0], T.fabs(x[0, 0, g * group + k]))
                    x_scale[g] = x_max[0] / T.float32(127)
                    inverse: T.let[T.float32] = T.if_then_else(
                        x_max[0] > T.float32(0), T.float32(127) / x_max[0], T.float32(0)
                    )
                    if bits == 4:
                        for j in T.serial(half):
                            x_even[g * half + j] = T.Cast("int8", T.nearbyint(x[0, 0, g * group + 2 * j] * inverse))
                            x_odd[g * half + j] = T.Cast("int8", T.nearbyint(x[0, 0, g * group + 2 * j + 1] * inverse))
                    else:
                        for j in T.serial(group):
                            x_even[g * group + j] = T.Cast("int8", T.nearbyint(x[0, 0, g * group + j] * inverse))
                    for lane in T.serial(4):
                        x_sums[g, lane] = T.float32(0)
                        for c in T.serial(per_group // INT8_BYTES):
                            for j in T.serial(4):
                                x_sums[g, lane] += rounded_x(
                                    x_even, x_odd, g * per_group + c * INT8_BYTES + lane * 4 + j
                                )
                for task in T.parallel(out_features // task_rows):  # a weight row at a time: one stream
                    with T.sblock("int8_rows"):
                        T.reads()
                        T.writes()
                        acc = T.sblock_alloc_buffer((unroll, 4), "float32", scope="local")
                        dots = T.sblock_alloc_buffer((unroll, 4), "int32", scope="local")
                        for row in T.serial(task_rows):
                            n: T.let[T.int32] = task * task_rows + row
                            for u in T.unroll(unroll):
                                acc[u, T.ramp(0, 1, 4)] = T.broadcast(T.float32(0), 4)
                            for g_outer in T.serial(groups // unroll):
                                for u in T.unroll(unroll):
                                    g: T.let[T.int32] = g_outer * unroll + u
                                    dots[u, T.ramp(0, 1, 4)] = T.broadcast(T.int32(0), 4)
                                    for c in T.unroll(per_group // INT8_BYTES):
                                        dots[u, T.ramp(0, 1, 4)] = weight_dot(
                                            dots[u, T.ramp(0, 1, 4)],
                                            qweight[n, g, T.ramp(c * INT8_BYTES, 1, INT8_BYTES)],
                                            x_even,
                                            x_odd,
                                            g * per_group + c * INT8_BYTES,
                                        )
                                    acc[u, T.ramp(0, 1, 4)] += (
                                        T.Cast("float32x4", dots[u, T.ramp(0, 1, 4)])
                                        - T.broadcast(zero_of(zero_buffer, n, g), 4) * x_sums[g, T.ramp(0, 1, 4)]
                                    ) * T.broadcast(scales[n, g] * x_scale[g], 4)
                            out[0, 0, n] = dot(acc, bias_buffer, range(unroll), 4, n)
            else:
                for i in T.parallel(a * b):
                    for k in T.serial(in_features):
                        x_order[i, k] = x[i // b, i % b, feature(k)]
                for chunk in T.parallel(out_features // ROWS):
                    if a * b == 1:  # decode: each weight read once, scaled per group
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
                                            x_sum[lane] += x_order[0, g * group + c * lanes + lane]
                                            if bits == 4:
                                                x_sum[lane] += x_order[0, g * group + half + c * lanes + lane]
                                        for r in T.unroll(decode_rows):
                                            for lane in T.vectorized(lanes):
                                                part[r, lane] += x_order[0, g * group + c * lanes + lane] * low(
                                                    qweight[first + r, g, c * lanes + lane]
                                                )
                                                if bits == 4:
                                                    part[r, lane] += x_order[
                                                        0, g * group + half + c * lanes + lane
                                                    ] * high(qweight[first + r, g, c * lanes + lane])
                                    for r in T.unroll(decode_rows):
                                        for lane in T.vectorized(lanes):
                                            acc[r, lane] += scales[first + r, g] * (
                                                part[r, lane] - zero_of(zero_buffer, first + r, g) * x_sum[lane]
                                            )
                                for r in T.unroll(decode_rows):
                                    out[0, 0, first + r] = dot(acc, bias_buffer, [r], lanes, first + r)
                    else:  # several rows: the chunk's weights dequantized once, then every row's dot products
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
                                                low(qweight[chunk * ROWS + r, g, c * lanes + lane])
                                                - zero_of(zero_buffer, chunk * ROWS + r, g)
                                            ) * scales[chunk * ROWS + r, g]
                                            if bits == 4:
                                                weight[r, g * group + half + c * lanes + lane] = (
                                                    high(qweight[chunk * ROWS + r, g, c * lanes + lane])
                                                    - zero_of(zero_buffer, chunk * ROWS + r, g)
                                                ) * scales[chunk * ROWS + r, g]
                            for i in T.serial(a * b):
                                for r in T.unroll(ROWS):
                                    for lane in T.vectorized(lanes):
                                        acc[r, lane] = T.float32(0)
                                for k in T.serial(in_features // lanes):
                                    for r in T.unroll(ROWS):
                                        for lane in T.vectorized(lanes):
                                            acc[r, lane] += x_order[i, k * lanes + lane] * weight[r, k * lanes + lane]
                                for r in T.unroll(ROWS):
                                    out[i // b, i % b, chunk * ROWS + r] = dot(
                                        acc, bias_buffer, [r], lanes, chunk * ROWS + r
                                    )

    return qlinear


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
    int8_dot: str | None = None,
) -> relax.Expr:
    """x [..., K] @ dequantize(w).T (+ bias) through the kernel, which takes x in three dims (a step's [1, tokens,
    K], or the LM head's [sequences, 1, K]); other ranks are reshaped to [1, rows, K] and back."""
    out_features = int(qweight.ty.shape[0])
    group = int(qweight.ty.shape[2]) * 8 // bits
    zero_kind = "none" if zeros is None else "nibbles" if zeros.ty.dtype == "uint8" else "float"
    placeholder = relax.const(np.zeros(1, "float32"))
    kernel = qlinear_kernel(out_features, in_features, group, bits, zero_kind, bias is not None, lanes, int8_dot)
    *lead, _ = x.ty.shape
    rows = x if len(lead) == 2 else bb.emit(relax.op.reshape(x, [1, -1, in_features]))
    args = [rows, qweight, scales, zeros if zeros is not None else placeholder]
    args.append(bb.emit(relax.op.astype(bias, "float32")) if bias is not None else placeholder)
    out = bb.emit(
        relax.call_tir(
            bb.add_func(kernel, "qlinear_groups"),
            args,
            relax.TensorType([rows.ty.shape[0], rows.ty.shape[1], out_features], "float32"),
        )
    )
    return out if len(lead) == 2 else bb.emit(relax.op.reshape(out, [*lead, out_features]))
