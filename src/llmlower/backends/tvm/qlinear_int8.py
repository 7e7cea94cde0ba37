"""The int8 CPU kernel of a grouped quantized linear layer (accuracy_level 4), as ONNX Runtime's MatMulNBits runs at
its level 4: each row of x rounded to int8 per group (scale max|x| / 127), the weight bytes multiplied into int32
lanes by int8_dot's instruction, and per group

    out[i, n] += scale[n, g] * x_scale[i, g] * (dot - zero[n, g] * the sum of x's integers).

Each thread takes whole weight rows and reads a row's bytes once per TILE activation rows, in the widest vectors the
CPU has (a 64-byte vector holds four groups of 32 4-bit weights), so that the float arithmetic of the groups runs on
whole vectors too: a vector's weight scales (and float zero points; float32 or float16) are read by one load and
spread over its lanes by one shuffle, shared by the tile's rows, and each x row's scales and sums once per call.
Where a group takes part of a vector's lanes, a block of vectors' int32 lanes is first summed to one lane a group
(lane_tree.group_sums), so that the float work runs once for as many groups as a vector has lanes. One
row (decode) is bound by memory, many (prompts, many streams) by the int8 instructions; converting every weight to
float32, the float kernel was bound by those conversions at both. Where the CPU has AMX's int8 tiles, calls of
MIN_ROWS rows or more take qlinear_amx's tiles instead (the same rounded integers); with AVX-512 VNNI but no AMX,
calls of REGISTER_ROWS rows or more take the same tiles' layout with their 16 x 16 sums in vector registers, each
weight row's four bytes broadcast against 16 rows of x, so that a group's float work is shared by 16 rows where the
vector loop's is done once per row."""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import NamedTuple

from tvm import tirx
from tvm.script import tirx as T

from .int8_dot import VNNI, Int8Dot, byte_offset, dot_bytes, dot_nibbles
from .int8_rounding import group_max_macro, inverse_scale
from .lane_tree import buffer_tree, group_sums, tree
from .paged_kernels import ATTRS
from .prefetch import prefetch
from .qlinear_amx import MIN_ROWS, TILE_ROWS, amx_macros, amx_shape, tiles_granted, tiles_of
from .qlinear_amx_bf16 import BF16_MIN_ROWS, DEPTH, bf16_macros, bf16_task_rows, x_tile_pairs
from .swiglu import Gate, swiglu

# bytes: each weight vector's load prefetches into L2 the line this far ahead in the weight rows (the next page:
# the hardware prefetchers stop at each 4 KiB page and learn the next one again). Llama-1B's shape, batch-1 decode,
# 2 threads on a Sapphire Rapids VM (26.6 GB/s copy bandwidth): 27.3-28.2 tok/s without, 37-38 with 2 KiB ahead,
# 41.3-42.3 with 4, 8 or 16 KiB; into L1 (prefetcht0) 35; non-temporal 18.7
STREAM_AHEAD = 4096
# weight-row tasks a call's rows split into at least: the thread pool hands each thread a contiguous share of
# ceil(tasks / threads), and 9 tasks (SmolLM2's 576 rows by 64) on 2 threads gave the main thread 5 (its perf samples
# in o_proj and down_proj 24-27% above the worker's); in 36 the halves are even. Decode +0.3-1.1% there (the threads
# share the bandwidth: one done early leaves the other more); more threads lose more to a coarse split
MIN_TASKS = 32
TILE = 4  # activation rows a weight vector is multiplied with while it is in a register (8 accumulators)
REGISTER_ROWS = 8  # rows of x from which AVX-512 VNNI without AMX takes tiles of 16 (padded) in registers


def rounds_activations(bits: int, group: int, int8_dot: Int8Dot | None) -> bool:
    """Whether a matmul runs in int8 here: groups of whole 16-byte vectors of 4- or 8-bit weights, on a CPU with
    an int8 dot product (8-bit weights without VNNI: as signed bytes, int8_dot.dot_bytes). Per-channel weights (one
    group a row) round each row of x once, as ONNX Runtime's integer GEMM does, and sum the row in int32: their
    rows are bounded so that 255 x 128 x the row's length stays an int32."""
    return int8_dot is not None and group * bits // 8 % 16 == 0 and group * 255 * 128 < 2**31


class Piece(NamedTuple):
    """A run of a weight row's vectors of one width: `count` vectors of `width` bytes from group `first` on."""

    width: int
    first: int
    count: int
    per_group: int  # bytes of a group

    @property
    def lanes(self) -> int:  # int32 (and float32) lanes of a vector
        return self.width // 4

    @property
    def per_vector(self) -> int:  # groups in a vector (1 where a group takes several)
        return max(1, self.width // self.per_group)

    @property
    def vectors(self) -> int:  # vectors a group takes
        return max(1, self.per_group // self.width)


def vector_pieces(per_group: int, groups: int, widest: int) -> list[Piece]:
    """A row's groups of `per_group` bytes in the widest vectors, up to `widest` bytes, that hold whole groups or a
    whole fraction of one, and the groups those leave in narrower ones: SmolLM2's 576 features in 4-bit groups of
    32 are four 64-byte vectors of four groups and a 32-byte one of two, where one width for the row took 32 bytes."""
    for width in (w for w in (64, 32, 16) if w <= widest):
        if per_group % width == 0:
            return [Piece(width, 0, groups, per_group)]
        if width % per_group == 0 and groups >= width // per_group:
            whole = groups // (width // per_group) * (width // per_group)
            rest = vector_pieces(per_group, groups - whole, width // 2) if whole < groups else []
            head = Piece(width, 0, whole // (width // per_group), per_group)
            return [head] + [piece._replace(first=piece.first + whole) for piece in rest]
    raise ValueError(f"groups of {per_group} bytes: not a multiple of 16")


def zero_layout(zeros: str, out_features: int, groups: int, scale_dtype: str) -> tuple[tuple[int, ...], str]:
    """The shape and dtype of the zero-point operand: `zeros` "none" (a one-element float32 placeholder never
    read), "float" (in the scales' dtype) or "nibbles" (as zero_point reads them)."""
    if zeros == "nibbles":
        return (out_features, (groups + 1) // 2), "uint8"
    return ((out_features, groups), scale_dtype) if zeros == "float" else ((1,), "float32")


def zero_point(zeros: str, bits: int, zero_buffer: tirx.Buffer, n: tirx.PrimExpr, g: tirx.PrimExpr) -> tirx.PrimExpr:
    """Group g's zero point of weight row n, float32: `zeros` "none" (symmetric: 8, or 128 for 8 bits), "float"
    (float32 or float16 [N, groups]) or "nibbles" (uint8 [N, ceil(groups / 2)], two groups a byte)."""
    if zeros == "float":
        return T.Cast("float32", zero_buffer[n, g])
    if zeros == "nibbles":
        return T.Cast("float32", (zero_buffer[n, g // 2] >> T.Cast("uint8", g % 2 * 4)) & T.uint8(15))
    return T.float32(2 ** (bits - 1))


def group_block(piece: Piece) -> int:
    """Vectors whose int32 lanes are summed to one lane a group before the groups' float work (scale, zero point),
    which then runs once for as many groups as a vector has lanes: as many as a group takes lanes (1: each vector's
    float work on its own, too few vectors for a block or one group a row)."""
    lanes_of_group = min(piece.per_group, piece.width) // 4
    return lanes_of_group if 1 < lanes_of_group <= piece.count else 1


def blocks_and_rest(piece: Piece) -> tuple[int, Piece]:
    """The piece's group_block, and the vectors its blocks leave (taken one at a time)."""
    block = group_block(piece)
    whole = piece.count // block * block if block > 1 else 0
    return block, piece._replace(first=piece.first + whole * piece.per_vector, count=piece.count - whole)


def out_rows(first: tirx.PrimExpr, b: tirx.PrimExpr) -> Callable:
    """Where rows first, first + 1, ... of a call's x [a, b, K], flattened, go in its out [a, b, N]."""
    return lambda r: ((first + r) // b, (first + r) % b)


def sorted_out_rows(order: tirx.Buffer, first: tirx.PrimExpr, top_k: tirx.PrimExpr) -> Callable:
    """Where the pairs at order[first], order[first + 1], ... go in a MoE matmul's out [T, top_k, N]."""
    return lambda r: (order[first + r] // top_k, order[first + r] % top_k)


@T.macro
def sort_pairs(ids, pairs, top_k, chosen, starts, order, active, count):  # noqa: ANN001 (TIR buffers)
    """The (token, expert) pairs of ids [T, top_k] by expert (a counting sort, stable): order, each expert's start and
    count of pairs, and the experts chosen (active[:count[0]])."""
    experts = T.meta_var(chosen.shape[0])
    for e in T.serial(experts):
        chosen[e] = 0
    for p in T.serial(pairs):
        chosen[ids[p // top_k, p % top_k]] += 1
    starts[0] = 0
    count[0] = 0
    for e in T.serial(experts):
        starts[e + 1] = starts[e] + chosen[e]
        if chosen[e] > 0:
            active[count[0]] = e
            count[0] += 1
        chosen[e] = 0
    for p in T.serial(pairs):
        e = T.meta_var(ids[p // top_k, p % top_k])
        order[starts[e] + chosen[e]] = T.Cast("int32", p)
        chosen[e] += 1


class Operands(NamedTuple):
    """The kernel's buffers, passed to its macros as one: the call's, then each path's own."""

    x: tirx.Buffer
    weight: tirx.Buffer  # uint8 [N, groups * bytes per group]: a row's groups one after another
    scales: tirx.Buffer
    zeros: tirx.Buffer
    bias: tirx.Buffer
    out: tirx.Buffer
    x_even: tirx.Buffer | None = None  # int8 [rows, ...]: x rounded (4-bit weights: each group's even features)
    x_odd: tirx.Buffer | None = None  # 4-bit weights: the odd features (high nibbles)
    x_scale: tirx.Buffer | None = None  # [rows, groups * group lanes]: each group's scale, in every lane it takes
    x_sums: tirx.Buffer | None = None  # [rows, groups * group lanes]: the sum of the rounded x each lane multiplies
    x_group_scale: tirx.Buffer | None = None  # [rows, groups]: each group's scale, once
    x_group_sums: tirx.Buffer | None = None  # [rows, groups]: the sum of each group's rounded x
    x_tiles: tirx.Buffer | None = None  # AMX: [tiles * 16 * in_features] int8, x rounded in tiles (qlinear_amx)
    x_scale_t: tirx.Buffer | None = None  # AMX: [groups, tiles * 16]: each group's scale, row by row
    x_sums_t: tirx.Buffer | None = None  # AMX: [groups, tiles * 16]: each group's rounded sum x its scale
    x_pairs: tirx.Buffer | None = None  # AMX bfloat16: uint32 [tiles * in_features / 2 * 16], qlinear_amx_bf16's


def int8_kernel(
    out_features: int,
    in_features: int,
    group: int,
    bits: int,
    zeros: str,
    bias: bool,
    int8_dot: Int8Dot,
    scale_dtype: str,
    experts: int = 0,
    shared_x: bool = False,
    gate: Gate | None = None,
) -> tirx.PrimFunc:
    """out [a, b, N] = x [a, b, K] @ dequantize(w).T (+ bias) with x rounded to int8 per group; the operands as
    qlinear_kernel's. With `experts`, a MoE layer's matmul over the router's choices: out [T, top_k, N] =
    x @ w[ids[t, j]].T (+ bias[ids[t, j]]), the operands with a leading [experts] and x [T, K] (`shared_x`: a token's
    row for all its experts) or [T * top_k, K] (a row each; with `gate`, [T * top_k, 2K] of interleaved gate/up
    pairs, each turned into one feature by swiglu.swiglu as the rows are gathered)."""
    groups = in_features // group
    per_group = group * bits // 8  # bytes
    pieces = vector_pieces(per_group, groups, int8_dot.widest)
    span = min(per_group, pieces[0].width)  # bytes of one group in a vector
    group_lanes = span // 4  # int32 lanes a group takes
    vectors = pieces[0].vectors
    lanes = pieces[0].lanes  # of the accumulators: a narrower piece adds into their first lanes
    task_rows = next(  # weight rows a task takes: up to 64, as many tasks as balance the threads
        (r for r in (64, 32, 16, 8, 4, 2) if out_features % r == 0 and out_features // r >= MIN_TASKS), 1
    )
    half = group // 2
    group_max = group_max_macro(group)
    zero_shape, zero_dtype = zero_layout(zeros, out_features, groups, scale_dtype)
    # tiles of 16 rows of x against 16 weight rows: AMX's where the CPU has them, else 16 x 16 sums in AVX-512
    # registers by vpdpbusd (qlinear_amx, in_registers)
    in_registers = not int8_dot.amx and int8_dot.kind == VNNI and int8_dot.widest == 64
    tiles = amx_shape(bits, group, out_features) if int8_dot.amx or in_registers else None
    operand_reads = (
        lambda k, n, g: zero_point(zeros, bits, k.zeros, n, g),
        lambda k, n, g: T.Cast("float32", k.scales[n, g]),
        lambda k, n: k.bias[n] if bias else T.float32(0),
    )
    if tiles is not None:
        # 16-bit scales and float zero points staged, and in registers nibble zero points too (their shifts per
        # weight row and group were as many instructions as the group's sums took); the rest read in place
        narrow = scale_dtype != "float32"
        staged = (narrow, (zeros == "float" and narrow) or (zeros == "nibbles" and in_registers))
        round_to_tiles, tile_weight_rows = amx_macros(
            tiles, group, groups, in_features, bits, *operand_reads, staged, in_registers
        )
        if in_registers:
            tiled = lambda rows: rows >= REGISTER_ROWS  # noqa: E731
        else:  # the syscall only where tiles would be taken (decode's one row never makes it)
            tiled = lambda rows: T.if_then_else(rows >= MIN_ROWS, tiles_granted(), False)  # noqa: E731
    # grouped 4-bit weights on bfloat16 tiles (8-bit ones and per-channel ones keep int8's, twice bfloat16's rate)
    bf16_task = bf16_task_rows(out_features, in_features)
    in_bf16 = int8_dot.amx_bf16 and bits == 4 and groups > 1 and in_features % DEPTH == 0 and bf16_task is not None
    if in_bf16:
        pairs_of_row, bf16_weight_rows = bf16_macros(group, in_features, out_features, *operand_reads)

    def rounded_x(k, i, at):  # the rounded x row i has at weight byte `at` (4-bit: both nibbles'), summed
        if bits == 4:
            return T.Cast("float32", k.x_even[i, at]) + T.Cast("float32", k.x_odd[i, at])
        return T.Cast("float32", k.x_even[i, at])

    def weight_dot(acc, weights, k, i, at, width):  # acc + a vector of weight bytes against row i's x from byte `at`
        x_bytes = T.ramp(at, 1, width)
        if bits == 8:
            return dot_bytes(int8_dot.kind, acc, weights, k.x_even[i, x_bytes], width)
        return dot_nibbles(int8_dot.kind, acc, weights, k.x_even[i, x_bytes], k.x_odd[i, x_bytes], width)

    def spread(values, piece):  # a vector's groups' values (one per group) over the lanes each group takes
        if piece.per_vector == 1:
            return T.broadcast(values[0], piece.lanes)
        return T.Shuffle([T.broadcast(value, group_lanes) for value in values], list(range(piece.lanes)))

    def loaded_lanes(buffer, n, g, piece):  # float values [N, groups] of the vector's groups from g: one load, spread
        if piece.per_vector == 1:
            return T.broadcast(T.Cast("float32", buffer[n, g]), piece.lanes)
        per_vector = piece.per_vector
        loaded = T.Cast(f"float32x{per_vector}", buffer[n, T.ramp(g, 1, per_vector)])
        # TVM's Shuffle yields at most its operands' lanes: the loaded vector repeated, its first copy's lanes taken
        return T.Shuffle([loaded] * group_lanes, [q for q in range(per_vector) for _ in range(group_lanes)])

    def nibble_lanes(k, n, g, piece):  # packed zero points of the vector's groups from g (even): shifted in the lanes
        count = piece.per_vector // 2  # bytes: 1 or 2
        packed = k.zeros[n, g // 2] if count == 1 else T.reinterpret("uint16", k.zeros[n, T.ramp(g // 2, 1, 2)])
        # the bytes repeated through every int32 lane by one broadcast load: group q's nibble sits 4q bits up in each
        repeated = T.reinterpret(f"int32x{piece.lanes}", T.broadcast(packed, piece.lanes * 4 // count))
        shifts = spread([T.int32(4 * q) for q in range(piece.per_vector)], piece)
        nibbles = (repeated >> shifts) & T.broadcast(T.int32(15), piece.lanes)
        return T.Cast(f"float32x{piece.lanes}", nibbles)

    def less_offset(points, lanes):  # zero points less what the dots take from each byte (vectors of `lanes` int32)
        offset = byte_offset(int8_dot.kind, lanes * 4) if bits == 8 else 0
        return points - T.broadcast(T.float32(offset), lanes) if offset else points

    def zero_lanes(k, n, g, piece):  # the zero points of the vector's groups from g, over their lanes, less the offset
        if zeros == "none":  # the dots take from each weight byte
            points = T.broadcast(zero_point(zeros, bits, k.zeros, n, 0), piece.lanes)
        elif zeros == "float":
            points = loaded_lanes(k.zeros, n, g, piece)
        elif piece.per_vector > 1:
            points = nibble_lanes(k, n, g, piece)
        else:
            points = T.broadcast(zero_point(zeros, bits, k.zeros, n, g), piece.lanes)
        return less_offset(points, piece.lanes)

    def lane_total(k, acc, r, n):  # row r's lanes summed, plus the bias
        return buffer_tree(operator.add, acc, (r,), lanes) + (k.bias[n] if bias else T.float32(0))

    @T.macro
    def round_row(k, i, b):  # row i of x rounded per group, with its scales and sums spread over the lanes
        for g in T.serial(groups):
            with T.sblock("round_group"):
                T.reads()
                T.writes()
                largest = T.sblock_alloc_buffer((1,), "float32")
                group_max(k, i, b, g, largest)
                inverse: T.let[T.float32] = inverse_scale(largest[0])
                if bits == 4:
                    for j in T.serial(half):
                        k.x_even[i, g * half + j] = T.Cast(
                            "int8", T.nearbyint(k.x[i // b, i % b, g * group + 2 * j] * inverse)
                        )
                        k.x_odd[i, g * half + j] = T.Cast(
                            "int8", T.nearbyint(k.x[i // b, i % b, g * group + 2 * j + 1] * inverse)
                        )
                else:
                    for j in T.serial(group):
                        k.x_even[i, g * group + j] = T.Cast(
                            "int8", T.nearbyint(k.x[i // b, i % b, g * group + j] * inverse)
                        )
                for lane in T.serial(group_lanes):
                    k.x_scale[i, g * group_lanes + lane] = largest[0] / T.float32(127)
                    k.x_sums[i, g * group_lanes + lane] = T.float32(0)
                    for c in T.serial(vectors):
                        for j in T.serial(4):
                            at = T.meta_var(g * per_group + c * span + lane * 4 + j)
                            k.x_sums[i, g * group_lanes + lane] += rounded_x(k, i, at)
                k.x_group_scale[i, g] = largest[0] / T.float32(127)
                k.x_group_sums[i, g] = tree(
                    operator.add, [k.x_sums[i, g * group_lanes + q] for q in range(group_lanes)]
                )

    @T.macro
    def vectors_of(k, acc, dots, n, first, rows, piece):  # a piece's groups, each vector's float work on its own
        for s in T.serial(piece.count):
            g = T.meta_var(piece.first + s * piece.per_vector)  # the vector's first group
            for r in T.unroll(rows):
                dots[r, T.ramp(0, 1, piece.lanes)] = T.broadcast(T.int32(0), piece.lanes)
            for c in T.unroll(piece.vectors):
                at = T.meta_var(piece.first * per_group + s * piece.width * piece.vectors + c * piece.width)
                T.evaluate(prefetch(k.weight[n, at + STREAM_AHEAD]))
                for r in T.unroll(rows):  # each weight vector read once for the rows
                    dots[r, T.ramp(0, 1, piece.lanes)] = weight_dot(
                        dots[r, T.ramp(0, 1, piece.lanes)],
                        k.weight[n, T.ramp(at, 1, piece.width)],
                        k,
                        first + r,
                        at,
                        piece.width,
                    )
            for r in T.unroll(rows):
                acc[r, T.ramp(0, 1, piece.lanes)] += (
                    T.Cast(f"float32x{piece.lanes}", dots[r, T.ramp(0, 1, piece.lanes)])
                    - zero_lanes(k, n, g, piece) * k.x_sums[first + r, T.ramp(g * group_lanes, 1, piece.lanes)]
                ) * (
                    loaded_lanes(k.scales, n, g, piece) * k.x_scale[first + r, T.ramp(g * group_lanes, 1, piece.lanes)]
                )

    def group_zeros(k, n, g, count):  # the zero points of groups g .. g + count (one a lane), less the offset
        if zeros == "float":
            points = T.Cast(f"float32x{count}", k.zeros[n, T.ramp(g, 1, count)])
        elif zeros == "nibbles":  # g even: each byte widened, repeated in two lanes, shifted to its nibble
            wide = T.Cast(f"int32x{count // 2}", k.zeros[n, T.ramp(g // 2, 1, count // 2)])
            ends = [T.broadcast(T.int32(0), count), T.broadcast(T.int32(4), count)]  # even groups low, odd high
            shifts = T.Shuffle(ends, [q + q % 2 * count for q in range(count)])
            nibbles = (T.Shuffle([wide, wide], [q // 2 for q in range(count)]) >> shifts) & T.broadcast(
                T.int32(15), count
            )
            points = T.Cast(f"float32x{count}", nibbles)
        else:
            points = T.broadcast(zero_point(zeros, bits, k.zeros, n, 0), count)
        return less_offset(points, count)

    def block_dots(k, i, n, piece, first_vector, block):  # a block's vectors against x row i, one float lane a group
        sums = []
        for v in range(block):
            dots = T.broadcast(T.int32(0), piece.lanes)
            for c in range(piece.vectors):
                at = piece.first * per_group + (first_vector + v) * piece.width * piece.vectors + c * piece.width
                dots = weight_dot(dots, k.weight[n, T.ramp(at, 1, piece.width)], k, i, at, piece.width)
            sums.append(dots)
        return T.Cast(f"float32x{piece.lanes}", group_sums(sums, piece.lanes, block))

    @T.macro
    def blocks_of(k, acc, n, first, rows, piece, block):  # the float work once for as many groups as lanes
        for s in T.serial(piece.count // block):
            for v in T.unroll(block * piece.vectors):
                T.evaluate(
                    prefetch(
                        k.weight[
                            n, piece.first * per_group + (s * block * piece.vectors + v) * piece.width + STREAM_AHEAD
                        ]
                    )
                )
            g = T.meta_var(piece.first + s * block * piece.per_vector)  # the block's first group
            count = T.meta_var(piece.lanes)
            for r in T.unroll(rows):
                acc[r, T.ramp(0, 1, count)] += (
                    block_dots(k, first + r, n, piece, s * block, block)
                    - group_zeros(k, n, g, count) * k.x_group_sums[first + r, T.ramp(g, 1, count)]
                ) * (
                    T.Cast(f"float32x{count}", k.scales[n, T.ramp(g, 1, count)])
                    * k.x_group_scale[first + r, T.ramp(g, 1, count)]
                )

    @T.macro
    def piece_of(k, acc, dots, n, first, rows, piece):  # the groups of one piece of row n's vectors, into acc
        block, rest = T.meta_var(blocks_and_rest(piece))
        if block > 1:
            blocks_of(k, acc, n, first, rows, piece, block)
        if rest.count > 0:
            vectors_of(k, acc, dots, n, first, rows, rest)

    @T.macro
    def rows_of(k, acc, dots, n, first, rows, out_at, column):  # x rows first .. first + rows against weight row n
        for r in T.unroll(rows):
            acc[r, T.ramp(0, 1, lanes)] = T.broadcast(T.float32(0), lanes)
        # vector_pieces gives a piece a width, so at most three (TVMScript has no loop over Python values)
        piece_of(k, acc, dots, n, first, rows, pieces[0])
        if len(pieces) > 1:
            piece_of(k, acc, dots, n, first, rows, pieces[1])
        if len(pieces) > 2:
            piece_of(k, acc, dots, n, first, rows, pieces[2])
        for r in T.unroll(rows):  # into out[out_at(r), column]
            k.out[out_at(r)[0], out_at(r)[1], column] = lane_total(k, acc, r, n)

    @T.macro
    def vector_rows(k, rows, b):  # every row on vector instructions
        if rows == 1:  # decode: no thread pool for one row
            round_row(k, 0, b)
        else:
            for i in T.parallel(rows):
                round_row(k, i, b)
        for task in T.parallel(out_features // task_rows):
            with T.sblock("weight_rows"):
                T.reads()
                T.writes()
                # the default scope: under 1 KiB they are stack slots LLVM keeps in registers ("local" ones were
                # heap workspace, allocated and freed per task and written back on every vector)
                acc = T.sblock_alloc_buffer((TILE, lanes), "float32")
                dots = T.sblock_alloc_buffer((TILE, lanes), "int32")
                for t in T.serial(rows // TILE):  # a tile's rounded x stays in cache over the weight rows
                    out_at = T.meta_var(out_rows(t * TILE, b))
                    for row in T.serial(task_rows):
                        n = T.meta_var(task * task_rows + row)
                        rows_of(k, acc, dots, n, t * TILE, TILE, out_at, n)
                for i in T.serial(rows % TILE):  # the rest (decode's one row) one at a time
                    out_at = T.meta_var(out_rows(rows // TILE * TILE + i, b))
                    for row in T.serial(task_rows):
                        n = T.meta_var(task * task_rows + row)
                        rows_of(k, acc, dots, n, rows // TILE * TILE + i, 1, out_at, n)

    @T.prim_func(s_tir=True, private=True)
    def qlinear_int8(x_h: T.handle, w_h: T.handle, s_h: T.handle, z_h: T.handle, b_h: T.handle, out_h: T.handle):
        T.func_attr(ATTRS)
        a, b = T.int64(), T.int64()
        x = T.match_buffer(x_h, (a, b, in_features), "float32")
        qweight = T.match_buffer(w_h, (out_features, groups, per_group), "uint8")
        scales = T.match_buffer(s_h, (out_features, groups), scale_dtype)
        zero_buffer = T.match_buffer(z_h, zero_shape, zero_dtype)
        bias_buffer = T.match_buffer(b_h, (out_features if bias else 1,), "float32")
        out = T.match_buffer(out_h, (a, b, out_features), "float32")
        weight = T.decl_buffer((out_features, groups * per_group), "uint8", data=qweight.data)
        with T.sblock("root"):
            T.reads()
            T.writes()
            operands = T.meta_var(Operands(x, weight, scales, zero_buffer, bias_buffer, out))
            # many rows on AMX tiles; the syscall only where they would be taken (decode's one row never makes it)
            if in_bf16 and T.if_then_else(a * b >= BF16_MIN_ROWS, tiles_granted(), False):
                with T.sblock("amx_bf16"):
                    T.reads()
                    T.writes()
                    padded_rows = T.meta_var(x_tile_pairs(a * b) * TILE_ROWS)
                    x_pairs = T.sblock_alloc_buffer((padded_rows * (in_features // 2),), "uint32")
                    k = T.meta_var(operands._replace(x_pairs=x_pairs))
                    for t in T.parallel(x_tile_pairs(a * b)):  # a tile's rows in one thread: they share its lines
                        for r in T.serial(TILE_ROWS):
                            pairs_of_row(k, t * TILE_ROWS + r, a * b, b)
                    for task in T.parallel(out_features // bf16_task):
                        bf16_weight_rows(k, task, a * b, b)
            elif tiles is not None and tiled(a * b):
                with T.sblock("tiles"):  # AMX's, or in AVX-512 registers
                    T.reads()
                    T.writes()
                    padded_rows = T.meta_var(tiles_of(a * b) * TILE_ROWS)
                    x_tiles = T.sblock_alloc_buffer((padded_rows * in_features,), "int8")
                    x_scale_t = T.sblock_alloc_buffer((groups, padded_rows), "float32")
                    x_sums_t = T.sblock_alloc_buffer((groups, padded_rows), "float32")
                    k = T.meta_var(operands._replace(x_tiles=x_tiles, x_scale_t=x_scale_t, x_sums_t=x_sums_t))
                    round_to_tiles(k, a * b, b)
                    for task in T.parallel(out_features // TILE_ROWS):
                        tile_weight_rows(k, task, a * b, b)
            else:
                with T.sblock("vector"):
                    T.reads()
                    T.writes()
                    x_even = T.sblock_alloc_buffer((a * b, in_features // 2 if bits == 4 else in_features), "int8")
                    x_odd = T.sblock_alloc_buffer((a * b, in_features // 2), "int8")
                    x_scale = T.sblock_alloc_buffer((a * b, groups * group_lanes), "float32")
                    x_sums = T.sblock_alloc_buffer((a * b, groups * group_lanes), "float32")
                    x_group_scale = T.sblock_alloc_buffer((a * b, groups), "float32")
                    x_group_sums = T.sblock_alloc_buffer((a * b, groups), "float32")
                    k = T.meta_var(
                        operands._replace(
                            x_even=x_even,
                            x_odd=x_odd,
                            x_scale=x_scale,
                            x_sums=x_sums,
                            x_group_scale=x_group_scale,
                            x_group_sums=x_group_sums,
                        )
                    )
                    vector_rows(k, a * b, b)

    if not experts:
        return qlinear_int8
    expert_zeros = zero_shape if zeros == "none" else (experts, *zero_shape)
    x_width = in_features if gate is None else 2 * in_features  # gate/up pairs

    def gathered(x, pair, top_k, f):  # feature f of the pair's row of x
        if gate is not None:
            return swiglu(x[pair, 2 * f], x[pair, 2 * f + 1], gate)
        return x[pair // top_k if shared_x else pair, f]

    tasks = out_features // task_rows  # per chosen expert, its weight rows split

    @T.prim_func(s_tir=True, private=True)
    def qlinear_int8_experts(
        x_h: T.handle, ids_h: T.handle, w_h: T.handle, s_h: T.handle, z_h: T.handle, b_h: T.handle, out_h: T.handle
    ):
        T.func_attr(ATTRS)
        x_rows, tokens, top_k = T.int64(), T.int64(), T.int64()
        x = T.match_buffer(x_h, (x_rows, x_width), "float32")
        ids = T.match_buffer(ids_h, (tokens, top_k), "int64")
        qweight = T.match_buffer(w_h, (experts, out_features, groups, per_group), "uint8")
        expert_scales = T.match_buffer(s_h, (experts, out_features, groups), scale_dtype)
        expert_zero_buffer = T.match_buffer(z_h, expert_zeros, zero_dtype)
        expert_bias = T.match_buffer(b_h, (experts, out_features) if bias else (1,), "float32")
        out = T.match_buffer(out_h, (tokens, top_k, out_features), "float32")
        # an expert's weight row n is row expert * N + n of the experts' rows laid end to end
        weight = T.decl_buffer((experts * out_features, groups * per_group), "uint8", data=qweight.data)
        scales = T.decl_buffer((experts * out_features, groups), scale_dtype, data=expert_scales.data)
        flat_zeros = zero_shape if zeros == "none" else (experts * out_features, zero_shape[-1])
        zero_buffer = T.decl_buffer(flat_zeros, zero_dtype, data=expert_zero_buffer.data)
        bias_buffer = T.decl_buffer((experts * out_features if bias else 1,), "float32", data=expert_bias.data)
        with T.sblock("root"):
            T.reads()
            T.writes()
            pairs = T.meta_var(tokens * top_k)
            chosen = T.sblock_alloc_buffer((experts,), "int32")  # pairs that chose each expert
            starts = T.sblock_alloc_buffer((experts + 1,), "int32")  # each expert's first pair in `order`
            order = T.sblock_alloc_buffer((pairs,), "int32")  # the pairs by expert, each expert's in token order
            active = T.sblock_alloc_buffer((experts,), "int32")  # the experts chosen, then how many
            count = T.sblock_alloc_buffer((1,), "int32")
            sort_pairs(ids, pairs, top_k, chosen, starts, order, active, count)
            x_sorted = T.sblock_alloc_buffer((pairs, 1, in_features), "float32")  # x's rows in `order`
            x_even = T.sblock_alloc_buffer((pairs, in_features // 2 if bits == 4 else in_features), "int8")
            x_odd = T.sblock_alloc_buffer((pairs, in_features // 2), "int8")
            x_scale = T.sblock_alloc_buffer((pairs, groups * group_lanes), "float32")
            x_sums = T.sblock_alloc_buffer((pairs, groups * group_lanes), "float32")
            x_group_scale = T.sblock_alloc_buffer((pairs, groups), "float32")
            x_group_sums = T.sblock_alloc_buffer((pairs, groups), "float32")
            k = T.meta_var(
                Operands(
                    x_sorted,
                    weight,
                    scales,
                    zero_buffer,
                    bias_buffer,
                    out,
                    x_even,
                    x_odd,
                    x_scale,
                    x_sums,
                    x_group_scale=x_group_scale,
                    x_group_sums=x_group_sums,
                )
            )
            for q in T.parallel(pairs):
                for f in T.vectorized(in_features):
                    x_sorted[q, 0, f] = gathered(x, order[q], top_k, f)
                round_row(k, q, 1)
            for task in T.parallel(count[0] * tasks):  # an expert's rows split between the threads
                with T.sblock("expert_rows"):
                    T.reads()
                    T.writes()
                    acc = T.sblock_alloc_buffer((TILE, lanes), "float32")
                    dots = T.sblock_alloc_buffer((TILE, lanes), "int32")
                    expert = T.meta_var(active[task // tasks])
                    first = T.meta_var(starts[expert])
                    for t in T.serial(chosen[expert] // TILE):  # TILE of its pairs read each weight vector once
                        out_at = T.meta_var(sorted_out_rows(order, first + t * TILE, top_k))
                        for row in T.serial(task_rows):
                            n = T.meta_var(task % tasks * task_rows + row)
                            rows_of(k, acc, dots, expert * out_features + n, first + t * TILE, TILE, out_at, n)
                    for i in T.serial(chosen[expert] % TILE):
                        at = T.meta_var(first + chosen[expert] // TILE * TILE + i)
                        out_at = T.meta_var(sorted_out_rows(order, at, top_k))
                        for row in T.serial(task_rows):
                            n = T.meta_var(task % tasks * task_rows + row)
                            rows_of(k, acc, dots, expert * out_features + n, at, 1, out_at, n)

    return qlinear_int8_experts
