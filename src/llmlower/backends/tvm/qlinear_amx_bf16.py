"""AMX's bfloat16 tiles for a grouped quantized linear layer's prompt-sized calls (BF16_MIN_ROWS rows of x or more) on
CPUs that have amx-bf16. The int8 tiles (qlinear_amx) take a group's scales after every multiply, 16 x 16 float
operations for each group of 32 features and tile of x, which bound a prompt chunk's matmul to half the rate of a
per-channel one. Here each task dequantizes its weight rows once to bfloat16 (scale x (q - zero): the groups' float
arithmetic done once for every tile of x), and tdpbf16ps multiplies 32 of them at a time by two tiles of 16 rows of
x in bfloat16, 32 features deep, into four tiles of float32 sums that need no scales, turned to out's layout in
vector registers. x rounds to bfloat16 (8 significant bits, nearest even) once per call, in the pairs' layout the B
tiles take: more precise than int8's per-group rounding, at half the int8 tiles' rate."""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from .qlinear_amx import TILE_ROWS, tiles_of, x86_intrinsic

BF16_MIN_ROWS = 96  # calls with fewer rows keep the int8 tiles (each call dequantizes the weights again)
DEPTH = 32  # features of one multiply: 16 pairs of bfloat16 in a 64-byte tile row
BLOCK_ROWS = 32  # weight rows multiplied at once: two A tiles, each by two B tiles of x (four C tiles)
# a task's dequantized weights at most (at least one block): they stay in L2 (2 MB a core on every CPU with AMX) beside
# a pair of x's tiles, and x streams from memory once per task (tasks of 256 KB: a 1B's 1,600-row gate/up 86 ms, now 69)
TASK_BYTES = 1024 * 1024
A_TILES, B_TILES = (4, 5), (6, 7)  # C tile of A tile a and B tile c: 2 * a + c


def bfloat16_bits(value: tirx.PrimExpr) -> tirx.PrimExpr:
    """The bfloat16 nearest `value` (float32; ties to even), as the low 16 bits of a uint32."""
    bits = T.reinterpret("uint32", value)
    return (bits + T.uint32(0x7FFF) + ((bits >> T.uint32(16)) & T.uint32(1))) >> T.uint32(16)


def pair(low: tirx.PrimExpr, high: tirx.PrimExpr) -> tirx.PrimExpr:
    """Two float32 values as the bfloat16 pair of one 32-bit lane, `low` first (the layout tdpbf16ps multiplies)."""
    return bfloat16_bits(low) | (bfloat16_bits(high) << T.uint32(16))


def butterfly_lanes(stage: int) -> tuple[list[int], list[int]]:
    """The lanes of a 16 x 16 transpose's stage: rows i and i + 2**stage (concatenated) give row i its own low
    lanes and the other's, and row i + 2**stage the rest, in blocks of 2**stage lanes."""
    d = 2**stage
    low = [lane if not lane & d else TILE_ROWS + lane - d for lane in range(TILE_ROWS)]
    high = [lane + d if not lane & d else TILE_ROWS + lane for lane in range(TILE_ROWS)]
    return low, high


def store_transposed(load, target: tirx.Buffer) -> None:
    """target[r, :] = column r of the 16 x 16 float32 rows load(i) gives: four stages of two-row shuffles in
    vector registers (one instruction each; LLVM merges the shared ones) instead of a gather per row."""
    lanes = T.ramp(0, 1, TILE_ROWS)
    rows = [load(i) for i in range(TILE_ROWS)]
    for stage in range(4):
        d, (low, high) = 2**stage, butterfly_lanes(stage)
        turned = list(rows)
        for i in (i for i in range(TILE_ROWS) if not i & d):
            turned[i], turned[i + d] = (T.Shuffle([rows[i], rows[i + d]], picked) for picked in (low, high))
        rows = turned
    for r in range(TILE_ROWS):
        T.buffer_store(target, rows[r], [r, lanes])


def bf16_task_rows(out_features: int, in_features: int) -> int | None:
    """Weight rows of a task: blocks of BLOCK_ROWS, as many as fit TASK_BYTES (each tile of x read from memory once
    for them all); None where the rows are not in whole blocks."""
    fitting = (r for r in (128, 64, 32) if out_features % r == 0 and r * in_features * 2 <= TASK_BYTES)
    return next(fitting, BLOCK_ROWS if out_features % BLOCK_ROWS == 0 else None)


def x_tile_pairs(rows: tirx.PrimExpr) -> tirx.PrimExpr:
    """Tiles of x the bfloat16 path multiplies: whole pairs of tiles (the last ones padded with zeros)."""
    return (tiles_of(rows) + 1) // 2 * 2


def bf16_macros(group: int, in_features: int, out_features: int, zero_of, scale_of, bias_of):
    """The bfloat16 path's two steps as TIR macros over the kernel's operands (qlinear_int8.Operands, x_pairs
    [x_tile_pairs(rows) * 16 * in_features / 2] uint32 among them), to run once tiles_granted():
    pairs_of_row(k, i, rows, b) and weight_rows(k, task, rows, b). zero_of, scale_of and bias_of as amx_macros'."""
    pairs = in_features // 2
    group_pairs = group // 2
    groups = in_features // group
    multiplies = in_features // DEPTH
    rows_of_task = bf16_task_rows(out_features, in_features)

    def weight_pair(k, n, p):  # the two 4-bit weights of byte p of weight row n (features 2p, 2p + 1), float32
        byte = k.weight[n, p]
        return T.Cast("float32", byte & T.uint8(15)), T.Cast("float32", byte >> T.uint8(4))

    @T.macro
    def pairs_of_row(k, i, rows, b):  # row i of x as bfloat16 pairs in the B tiles' layout: row i % 16 of each
        first = T.meta_var(i // TILE_ROWS * pairs * TILE_ROWS + i % TILE_ROWS)
        if i < rows:
            for p in T.serial(pairs):
                k.x_pairs[first + p * TILE_ROWS] = pair(k.x[i // b, i % b, 2 * p], k.x[i // b, i % b, 2 * p + 1])
        else:  # padding: zeros multiply into sums never written out
            for p in T.serial(pairs):
                k.x_pairs[first + p * TILE_ROWS] = T.uint32(0)

    @T.macro
    def configure(config):  # palette 1: all eight tiles 16 rows of 64 bytes
        for byte in T.serial(64):
            config[byte] = T.uint8(0)
        config[0] = T.uint8(1)
        for tile in T.unroll(8):
            config[16 + 2 * tile] = T.uint8(64)
            config[48 + tile] = T.uint8(TILE_ROWS)
        x86_intrinsic("ldtilecfg", T.address_of(config[0]))

    @T.macro
    def load(k, weights, w, t2, q, tile):  # A tile `tile` (0, 1: block w's weight rows) or B tile (2, 3: x)
        if tile < 2:
            at = T.meta_var(T.address_of(weights[w * BLOCK_ROWS + tile * TILE_ROWS, q * 16]))
            x86_intrinsic("tileloadd64", T.int8(A_TILES[tile]), at, T.int64(pairs * 4))
        else:
            at = T.meta_var(T.address_of(k.x_pairs[((2 * t2 + tile - 2) * pairs + q * 16) * TILE_ROWS]))
            x86_intrinsic("tileloadd64", T.int8(B_TILES[tile - 2]), at, T.int64(64))

    @T.macro
    def multiply(k, weights, w, t2, q):  # the four C tiles += multiply q of block w's weight tiles x two tiles of x
        load(k, weights, w, t2, q, 0)
        load(k, weights, w, t2, q, 1)
        load(k, weights, w, t2, q, 2)
        load(k, weights, w, t2, q, 3)
        x86_intrinsic("tdpbf16ps", T.int8(0), T.int8(A_TILES[0]), T.int8(B_TILES[0]))
        x86_intrinsic("tdpbf16ps", T.int8(1), T.int8(A_TILES[0]), T.int8(B_TILES[1]))
        x86_intrinsic("tdpbf16ps", T.int8(2), T.int8(A_TILES[1]), T.int8(B_TILES[0]))
        x86_intrinsic("tdpbf16ps", T.int8(3), T.int8(A_TILES[1]), T.int8(B_TILES[1]))

    @T.macro
    def write_tile(k, sums, turned, first, t2, a, c, rows, b):  # C tile 2a + c: out[tile 2 * t2 + c, weight rows a]
        x86_intrinsic("tilestored64", T.int8(2 * a + c), T.address_of(sums[0, 0]), T.int64(64))
        store_transposed(lambda i: sums[i, T.ramp(0, 1, TILE_ROWS)], turned)
        for r in T.serial(TILE_ROWS):
            row = T.meta_var((2 * t2 + c) * TILE_ROWS + r)
            if row < rows:
                for n in T.vectorized(TILE_ROWS):
                    at = T.meta_var(first + a * TILE_ROWS + n)
                    k.out[row // b, row % b, at] = turned[r, n] + bias_of(k, at)

    @T.macro
    def write_out(k, sums, turned, first, t2, rows, b):  # the four C tiles into out's rows of the two tiles of x
        write_tile(k, sums, turned, first, t2, 0, 0, rows, b)
        write_tile(k, sums, turned, first, t2, 0, 1, rows, b)
        write_tile(k, sums, turned, first, t2, 1, 0, rows, b)
        write_tile(k, sums, turned, first, t2, 1, 1, rows, b)

    @T.macro
    def weight_rows(k, task, rows, b):  # out[:, the task's weight rows]
        with T.sblock("bf16_weight_rows"):
            T.reads()
            T.writes()
            config = T.sblock_alloc_buffer((64,), "uint8")
            weights = T.sblock_alloc_buffer((rows_of_task, pairs), "uint32")
            sums = T.sblock_alloc_buffer((TILE_ROWS, TILE_ROWS), "float32")  # a C tile: [weight row, x row]
            turned = T.sblock_alloc_buffer((TILE_ROWS, TILE_ROWS), "float32")  # [x row, weight row]
            first = T.meta_var(task * rows_of_task)
            configure(config)
            for n, g in T.grid(rows_of_task, groups):  # dequantized once for every tile of x
                scale: T.let[T.float32] = scale_of(k, first + n, g)
                offset: T.let[T.float32] = scale * zero_of(k, first + n, g)
                for j in T.vectorized(group_pairs):
                    low, high = T.meta_var(weight_pair(k, first + n, g * group_pairs + j))
                    weights[n, g * group_pairs + j] = pair(low * scale - offset, high * scale - offset)
            for t2, w in T.grid(x_tile_pairs(rows) // 2, rows_of_task // BLOCK_ROWS):
                x86_intrinsic("tilezero", T.int8(0))
                x86_intrinsic("tilezero", T.int8(1))
                x86_intrinsic("tilezero", T.int8(2))
                x86_intrinsic("tilezero", T.int8(3))
                for q in T.serial(multiplies):
                    multiply(k, weights, w, t2, q)
                write_out(k, sums, turned, first + w * BLOCK_ROWS, t2, rows, b)
            x86_intrinsic("tilerelease")

    return pairs_of_row, weight_rows
