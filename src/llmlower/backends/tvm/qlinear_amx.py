"""AMX tiles for the int8 kernel's many-row calls (prompt chunks, many-stream steps) on CPUs that have them (amx-tile
and amx-int8: Intel Sapphire Rapids and later). One tdpbusd multiplies a tile of 16 weight rows (unsigned bytes, up
to 64 deep) by a tile of 16 rows of x (signed bytes, four deep in each 32-bit lane: AMX's VNNI layout) into 16 x 16
int32 sums, where AVX-512's vpdpbusd makes 16; a group's sums then take its scales and zero point in float vectors,
16 rows of x at a time, as qlinear_int8's vector kernel does lane by lane.

x is rounded per group exactly as the vector kernel rounds it (the same integers: the two paths differ by float
summation order only) and stored in tiles of 16 rows, each group's features in stream order: for 4-bit weights its
even features (the low nibbles) then its odd ones, for 8-bit weights as they come. A task (16 weight rows) unpacks its
4-bit weights into bytes in that order, 64 packed bytes by one shuffle: with one tile of x (a step of up to 16
streams) a window ahead into a small buffer that stays in L1, with more (prompt chunks) all at once for every tile;
it prefetches the next task's weights and scales meanwhile. 8-bit weights are read in place. Linux hands a
process the tiles' state only when asked (arch_prctl), so each call asks first (once granted, a cheap no-op) and
keeps the vector path if refused.

Without AMX, AVX-512 VNNI runs the same layout in registers (in_registers): a C tile's 16 x 16 sums are 16 vectors,
and each four bytes of a weight row, broadcast, meet the 16 rows of x's four bytes in one vpdpbusd; every group is
unpacked with the task's bytes at once and its sums take their scales straight after its multiply. Per weight byte
that is one instruction for 16 rows and a group's float work once per 16 rows, where the vector loop does that work
once per row (docs/benchmarks.md has the timings)."""

from __future__ import annotations

import math
from typing import NamedTuple

from tvm import DataType, tirx
from tvm.script import tirx as T

from .int8_dot import VNNI, dot_u8_s8
from .int8_rounding import group_max_macro, inverse_scale
from .lane_tree import lane_sum
from .prefetch import LINE_BYTES, prefetch

TILE_ROWS = 16  # rows of every tile: weight rows of A, x rows of B (as 4-byte lanes), both of C
MAX_DEPTH = 64  # bytes of a row of an A tile: the reduction one tdpbusd takes
HALF = TILE_ROWS // 2
MIN_ROWS = 16  # calls with fewer rows of x stay on the vector kernel (decode's one row is bound by memory)
SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA = 158, 0x1023, 18
C_TILE, A_TILE, B_TILE = 0, 2, 3  # the first of two C tiles (0, 1), A (2, 4) and B (3, 5) tiles


class AmxShape(NamedTuple):
    """How a group's weights split into tile multiplies."""

    streams: int  # 2 for 4-bit weights (low nibbles, then high), 1 for 8-bit
    stream_bytes: int  # a group's features in one stream
    depth: int  # bytes of one multiply's A rows: a whole fraction of a group, its streams one after another


def amx_shape(bits: int, group: int, out_features: int) -> AmxShape | None:
    """The split of a group for AMX, or None where the layer does not take it (weight rows not in tiles of 16, a
    group not in multiplies of whole 4-byte lanes, 4-bit groups over 128: their unpacking takes whole groups of a
    64-byte vector)."""
    depth = next((d for d in range(MAX_DEPTH, 0, -4) if group % d == 0), None)  # the deepest multiply that fits
    streams = 2 if bits == 4 else 1
    if out_features % TILE_ROWS or depth is None or (bits == 4 and 64 % (group // streams)):
        return None
    return AmxShape(streams, group // streams, depth)


def tiles_of(rows: tirx.PrimExpr) -> tirx.PrimExpr:
    """Tiles of x holding `rows` rows (the last one padded)."""
    return (rows + TILE_ROWS - 1) // TILE_ROWS


def tile_rows(t: tirx.PrimExpr) -> tirx.PrimExpr:
    """The rows of x in tile t, as a vector index."""
    return T.ramp(t * TILE_ROWS, 1, TILE_ROWS)


def x86_intrinsic(name: str, *args: tirx.PrimExpr) -> None:
    """Emit the x86 instruction llvm.x86.<name> (AMX tile operations) with `args` (tile numbers as int8 immediates)."""
    T.evaluate(T.call_llvm_intrin("void", f"llvm.x86.{name}", *args))


def tiles_granted() -> tirx.PrimExpr:
    """Whether Linux lets this process use the tiles' state (arch_prctl asks for it; a no-op once granted): where it
    does not (a sandbox refusing the call), the kernel keeps its vector path instead of dying at the first tile."""
    request = (T.int64(SYS_ARCH_PRCTL), T.int64(ARCH_REQ_XCOMP_PERM), T.int64(XFEATURE_XTILEDATA))
    return T.call_extern("int64", "syscall", *request) == T.int64(0)


def tile_position(shape: AmxShape, in_features: int, p: tirx.PrimExpr, row: tirx.PrimExpr) -> tirx.PrimExpr:
    """Where feature `p` (in stream order) of x row `row` sits among the tiles: its tile of 16 rows, in it the
    multiplies of `depth` bytes one after another, each depth / 4 rows of 64 bytes (the 16 rows' four bytes side by
    side)."""
    depth = shape.depth
    within = p // depth * depth * TILE_ROWS + p % depth // 4 * 64 + row % TILE_ROWS * 4 + p % 4
    return row // TILE_ROWS * TILE_ROWS * in_features + within


def amx_macros(
    shape: AmxShape,
    group: int,
    groups: int,
    in_features: int,
    bits: int,
    zero_of,
    scale_of,
    bias_of,
    staged: tuple[bool, bool] = (False, False),
    in_registers: bool = False,
):
    """The tile path's two steps as TIR macros over the kernel's operands (qlinear_int8.Operands: x_tiles
    [tiles * 16 * in_features] int8, x_scale_t and x_sums_t [groups, tiles * 16] float32 among them), to run once
    tiles_granted() (`in_registers`: AVX-512 VNNI's registers instead, no grant needed): round_to_tiles(k, rows, b)
    and weight_rows(k, task, rows, b). zero_of(k, n, g),
    scale_of(k, n, g) and bias_of(k, n): weight row n's group g zero point and scale, and its bias, as float32.
    `staged` (scales, zero points): those a task widens to float32 for its 16 rows once, up front, where the drain
    would convert them for every weight row and group (16-bit ones); float32 ones, zero points in nibbles (staging
    them measured slower on SmolLM2's q4mix-a8) and constant ones are read in place."""
    streams, stream_bytes, depth = shape
    stage_scales, stage_zeros = staged
    sums_scope = "global" if in_registers else "local"
    group_max = group_max_macro(group)
    unpack = bits == 4
    row_bytes = in_features * bits // 8
    window = math.gcd(row_bytes, 64)  # packed bytes unpacked at once: whole groups (amx_shape sees to it)
    window_groups, windows = (window * 2 // group, row_bytes // window) if unpack else (1, 1)  # 4-bit weights
    # where each unpacked byte of a window comes from (its low nibbles 0.., its high ones window..): stream order
    in_stream_order = [
        u // (2 * stream_bytes) * stream_bytes + u % stream_bytes + window * (u // stream_bytes % 2)
        for u in range(2 * window)
    ]
    chunk_bytes = math.gcd(stream_bytes, 16)  # each stream's bytes of x rounded at once
    chunk = chunk_bytes * streams  # features of x rounded at once: one vector (two for 4-bit weights)
    side_by_side = math.gcd(chunk_bytes, 4)  # bytes stored at once: adjacent bytes of a tile row
    to_stream_order = [m * streams + s for s in range(streams) for m in range(chunk_bytes)]

    @T.macro
    def round_group_to_tiles(k, i, g, rows, b):  # group g of row i of x rounded into its tile, its scale and sum
        if i >= rows:  # a padding row of the last tile: scale and sums 0, so that its int32 sums come to 0.0
            k.x_scale_t[g, i] = T.float32(0)
            k.x_sums_t[g, i] = T.float32(0)
        else:
            with T.sblock("round_group"):
                T.reads()
                T.writes()
                rounded = T.sblock_alloc_buffer((chunk,), "int8")  # a chunk's, in stream order
                sums = T.sblock_alloc_buffer((chunk,), "int32")  # in registers, by lanes
                largest = T.sblock_alloc_buffer((1,), "float32")
                group_max(k, i, b, g, largest)
                inverse: T.let[T.float32] = inverse_scale(largest[0])
                k.x_scale_t[g, i] = largest[0] / T.float32(127)
                sums[T.ramp(0, 1, chunk)] = T.broadcast(T.int32(0), chunk)
                for c in T.serial(group // chunk):
                    values = T.meta_var(k.x[i // b, i % b, T.ramp(g * group + c * chunk, 1, chunk)])
                    scaled = T.meta_var(T.Cast(f"int8x{chunk}", T.nearbyint(values * T.broadcast(inverse, chunk))))
                    rounded[T.ramp(0, 1, chunk)] = T.Shuffle([scaled], to_stream_order)
                    sums[T.ramp(0, 1, chunk)] += T.Cast(f"int32x{chunk}", rounded[T.ramp(0, 1, chunk)])
                    for s, j in T.grid(streams, chunk_bytes // side_by_side):
                        p = T.meta_var(g * group + s * stream_bytes + c * chunk_bytes + j * side_by_side)
                        at = T.meta_var(T.ramp(s * chunk_bytes + j * side_by_side, 1, side_by_side))
                        k.x_tiles[T.ramp(tile_position(shape, in_features, p, i), 1, side_by_side)] = rounded[at]
                # what a zero point of 1 takes off the group
                total = T.meta_var(lane_sum(sums[T.ramp(0, 1, chunk)], "int32"))
                k.x_sums_t[g, i] = T.Cast("float32", total) * k.x_scale_t[g, i]

    @T.macro
    def round_to_tiles(k, rows, b):  # x rounded into tiles, a tile's rows of a group in one thread: they share
        # each of its cache lines, 4 bytes each (split between threads, every line of a step's one tile went back
        # and forth between the cores); a tile's groups split between the threads
        for part in T.parallel(tiles_of(rows) * groups):
            for r in T.serial(TILE_ROWS):
                round_group_to_tiles(k, part // groups * TILE_ROWS + r, part % groups, rows, b)

    @T.macro
    def configure(config):  # palette 1: two of each, C 16 rows of 16 int32, A 16 rows of `depth` bytes, B depth / 4
        for byte in T.serial(64):  # rows of 64
            config[byte] = T.uint8(0)
        config[0] = T.uint8(1)
        for tiles in T.unroll(2):  # a row's bytes at 16 + 2 x tile (16-bit, little-endian), its rows at 48 + tile
            config[16 + 2 * (C_TILE + tiles)] = T.uint8(64)
            config[48 + C_TILE + tiles] = T.uint8(TILE_ROWS)
            config[16 + 2 * (A_TILE + 2 * tiles)] = T.uint8(depth)
            config[48 + A_TILE + 2 * tiles] = T.uint8(TILE_ROWS)
            config[16 + 2 * (B_TILE + 2 * tiles)] = T.uint8(64)
            config[48 + B_TILE + 2 * tiles] = T.uint8(depth // 4)
        x86_intrinsic("ldtilecfg", T.address_of(config[0]))

    @T.macro
    def prefetch_part(buffer, first, g):  # group g's share of the next task's rows of a [out_features, ...] buffer
        element_bits = T.meta_var(DataType(buffer.dtype).bits)
        row_bytes_of = T.meta_var(buffer.shape[1] * element_bits // 8)
        share = T.meta_var(TILE_ROWS * row_bytes_of // groups)  # bytes: the 16 rows are one run
        for line in T.unroll(-(-share // LINE_BYTES)):
            at = T.meta_var(g * share + line * LINE_BYTES)
            T.evaluate(prefetch(buffer[first + TILE_ROWS + at // row_bytes_of, at % row_bytes_of * 8 // element_bits]))

    @T.macro
    def unpack_window(k, unpacked, first, r, w, slot):  # window w of weight row first + r as bytes, in stream order
        packed = T.meta_var(k.weight[first + r, T.ramp(w * window, 1, window)])
        low_nibbles = T.meta_var(packed & T.broadcast(T.uint8(15), window))
        high_nibbles = T.meta_var(packed >> T.broadcast(T.uint8(4), window))
        unpacked[r, T.ramp(slot * 2 * window, 1, 2 * window)] = T.Shuffle([low_nibbles, high_nibbles], in_stream_order)

    @T.macro
    def ahead(k, unpacked, one_tile, first, t, g):  # before group g's multiply: what later ones will read, fetched
        if t == 0 and first + TILE_ROWS < k.weight.shape[0]:  # the next task's weights and scales, a group's share
            prefetch_part(k.weight, first, g)
            prefetch_part(k.scales, first, g)
        w = T.meta_var(g // window_groups)
        if one_tile and unpack and g % window_groups == 0 and w + 1 < windows:  # the next window, one ahead so
            for r in T.serial(TILE_ROWS):  # that its stores are in L1 by the time tiles load them
                unpack_window(k, unpacked, first, r, w + 1, (w + 1) % 2)

    def weight_at(buffer, one_tile, first, n, g, at, size=1):  # weight row first + n's element `at` (stream order)
        if unpack:  # one tile: the group's place in its window's half of the buffer; more: in the task's bytes
            place = g // window_groups % 2 * window_groups + g % window_groups if one_tile else g
            return buffer[n, (place * group + at - g * group) // size]
        return buffer[first + n, at // size]  # 8-bit weights: a group's bytes are its features, in place

    @T.macro
    def multiply(k, tiles, unpacked, one_tile, first, t, g):  # C tile `tiles` = group g of the 16 weight rows x tile t
        ahead(k, unpacked, one_tile, first, t, g)
        x86_intrinsic("tilezero", T.int8(C_TILE + tiles))
        for q in T.serial(group // depth):
            at = T.meta_var(g * group + q * depth)  # in stream order
            weights = T.meta_var(T.address_of(weight_at(unpacked if unpack else k.weight, one_tile, first, 0, g, at)))
            x_rows = T.meta_var(T.address_of(k.x_tiles[(t * in_features + at) * TILE_ROWS]))
            stride = T.meta_var(unpacked.shape[1] if unpack else row_bytes)
            x86_intrinsic("tileloadd64", T.int8(A_TILE + 2 * tiles), weights, T.int64(stride))
            x86_intrinsic("tileloadd64", T.int8(B_TILE + 2 * tiles), x_rows, T.int64(64))
            x86_intrinsic("tdpbusd", T.int8(C_TILE + tiles), T.int8(A_TILE + 2 * tiles), T.int8(B_TILE + 2 * tiles))

    @T.macro
    def multiply_in_registers(k, sums, unpacked, one_tile, first, t, g):  # sums[0] = the same by vpdpbusd
        ahead(k, unpacked, one_tile, first, t, g)
        bytes_of = T.meta_var(unpacked if unpack else k.weight)
        words = T.decl_buffer((bytes_of.shape[0], bytes_of.shape[1] // 4), "int32", data=bytes_of.data)
        for n in T.unroll(TILE_ROWS):
            sums[0, n, T.ramp(0, 1, TILE_ROWS)] = T.broadcast(T.int32(0), TILE_ROWS)
        for q in T.serial(group // 4):  # four bytes deep: one int32 lane of the x tile's rows, 16 side by side
            at = T.meta_var(g * group + q * 4)  # in stream order
            x_quad = T.meta_var(k.x_tiles[T.ramp((t * in_features + at) * TILE_ROWS, 1, 4 * TILE_ROWS)])
            for n in T.unroll(TILE_ROWS):  # weight row n's four bytes in every lane, against the 16 rows' four
                weight = T.meta_var(weight_at(words, one_tile, first, n, g, at, 4))
                spread = T.meta_var(T.reinterpret(f"uint8x{4 * TILE_ROWS}", T.broadcast(weight, TILE_ROWS)))
                sums[0, n, T.ramp(0, 1, TILE_ROWS)] = dot_u8_s8(
                    VNNI, sums[0, n, T.ramp(0, 1, TILE_ROWS)], spread, x_quad, 4 * TILE_ROWS
                )

    def scale_at(k, staged_rows, first, n, g):  # the task's weight row n, group g: its scale as float32
        return staged_rows[0][n, g] if stage_scales else scale_of(k, first + n, g)

    def zero_at(k, staged_rows, first, n, g):  # and its zero point
        return staged_rows[1][n, g] if stage_zeros else zero_of(k, first + n, g)

    @T.macro
    def stage(k, staged_rows, first):  # the task's staged scales and zero points, widened once
        if stage_scales or stage_zeros:
            for n in T.serial(TILE_ROWS):
                for g in T.vectorized(groups):
                    if stage_scales:
                        staged_rows[0][n, g] = scale_of(k, first + n, g)
                    if stage_zeros:
                        staged_rows[1][n, g] = zero_of(k, first + n, g)

    @T.macro
    def drain_half(k, staged_rows, tiles, sums, acc, half, first, t, g):  # half of the C tile's weight rows into acc
        for n in T.unroll(HALF):
            scale = T.meta_var(scale_at(k, staged_rows, first, half + n, g))
            zero = T.meta_var(zero_at(k, staged_rows, first, half + n, g))
            acc[n, T.ramp(0, 1, TILE_ROWS)] += T.broadcast(scale, TILE_ROWS) * (
                T.Cast(f"float32x{TILE_ROWS}", sums[tiles, half + n, T.ramp(0, 1, TILE_ROWS)])
                * k.x_scale_t[g, tile_rows(t)]
                - T.broadcast(zero, TILE_ROWS) * k.x_sums_t[g, tile_rows(t)]
            )

    @T.macro
    def drain(k, staged_rows, tiles, sums, low, high, first, t, g):  # C tile `tiles`, group g's sums, into acc
        x86_intrinsic("tilestored64", T.int8(C_TILE + tiles), T.address_of(sums[tiles, 0, 0]), T.int64(4 * TILE_ROWS))
        drain_half(k, staged_rows, tiles, sums, low, 0, first, t, g)
        drain_half(k, staged_rows, tiles, sums, high, HALF, first, t, g)

    @T.macro
    def tile_of_x(k, staged_rows, sums, low, high, unpacked, one_tile, first, t, rows, b):  # out[tile t's rows, 16]
        for n in T.unroll(HALF):
            low[n, T.ramp(0, 1, TILE_ROWS)] = T.broadcast(T.float32(0), TILE_ROWS)
            high[n, T.ramp(0, 1, TILE_ROWS)] = T.broadcast(T.float32(0), TILE_ROWS)
        if one_tile and unpack:  # the first window (the others are unpacked a window ahead)
            for r in T.serial(TILE_ROWS):
                unpack_window(k, unpacked, first, r, 0, 0)
        if in_registers:  # the sums are registers: each group's taken straight after its multiply
            for g in T.serial(groups):
                multiply_in_registers(k, sums, unpacked, one_tile, first, t, g)
                drain_half(k, staged_rows, 0, sums, low, 0, first, t, g)
                drain_half(k, staged_rows, 0, sums, high, HALF, first, t, g)
        else:  # two C tiles in turn: a group's multiply runs while the previous group's sums take their scales
            multiply(k, 0, unpacked, one_tile, first, t, 0)
            for pair in T.serial(groups // 2):
                multiply(k, 1, unpacked, one_tile, first, t, 2 * pair + 1)
                drain(k, staged_rows, 0, sums, low, high, first, t, 2 * pair)
                if 2 * pair + 2 < groups:
                    multiply(k, 0, unpacked, one_tile, first, t, 2 * pair + 2)
                drain(k, staged_rows, 1, sums, low, high, first, t, 2 * pair + 1)
            if groups % 2 == 1:
                drain(k, staged_rows, 0, sums, low, high, first, t, groups - 1)
        for r in T.unroll(TILE_ROWS):
            if t * TILE_ROWS + r < rows:
                row = T.meta_var(t * TILE_ROWS + r)
                for n in T.unroll(HALF):
                    k.out[row // b, row % b, first + n] = low[n, r] + bias_of(k, first + n)
                    k.out[row // b, row % b, first + HALF + n] = high[n, r] + bias_of(k, first + HALF + n)

    @T.macro
    def weight_rows(k, task, rows, b):  # out[:, task's 16 weight rows]
        with T.sblock("tile_weight_rows"):
            T.reads()
            T.writes()
            config = T.sblock_alloc_buffer((64,), "uint8")
            # a C tile's sums: stored by tiles, two of them ("local": heap workspace); in registers, one (buffers of
            # the default scope up to 1 KiB become stack slots LLVM keeps in registers)
            sums = T.sblock_alloc_buffer((1 if in_registers else 2, TILE_ROWS, TILE_ROWS), "int32", scope=sums_scope)
            # the sums so far of the task's weight rows, in registers
            low = T.sblock_alloc_buffer((HALF, TILE_ROWS), "float32")
            high = T.sblock_alloc_buffer((HALF, TILE_ROWS), "float32")
            task_scales = T.sblock_alloc_buffer((TILE_ROWS, groups) if stage_scales else (1, 1), "float32")
            task_zeros = T.sblock_alloc_buffer((TILE_ROWS, groups) if stage_zeros else (1, 1), "float32")
            staged_rows = T.meta_var((task_scales, task_zeros))
            if not in_registers:
                configure(config)
            first = T.meta_var(task * TILE_ROWS)
            stage(k, staged_rows, first)
            # one tile of x on AMX (a step of up to 16 streams): a window's bytes at a time, in L1
            if not in_registers and rows <= TILE_ROWS:
                with T.sblock("one_tile"):
                    T.reads()
                    T.writes()
                    unpacked = T.sblock_alloc_buffer((TILE_ROWS, 4 * window if unpack else 1), "uint8")  # two windows
                    tile_of_x(k, staged_rows, sums, low, high, unpacked, True, first, T.int64(0), rows, b)
            else:  # more (prompt chunks): the task's bytes once, for every tile
                with T.sblock("many_tiles"):
                    T.reads()
                    T.writes()
                    unpacked = T.sblock_alloc_buffer((TILE_ROWS, in_features if unpack else 1), "uint8")
                    if unpack:
                        for r, w in T.grid(TILE_ROWS, windows):
                            unpack_window(k, unpacked, first, r, w, w)
                    for t in T.serial(tiles_of(rows)):
                        tile_of_x(k, staged_rows, sums, low, high, unpacked, False, first, t, rows, b)
            if not in_registers:
                x86_intrinsic("tilerelease")

    return round_to_tiles, weight_rows
