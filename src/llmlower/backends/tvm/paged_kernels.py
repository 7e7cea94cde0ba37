"""Paged attention over a block pool the caller owns: TIR kernels and the Relax calls that emit them.

The runtime's block table is the single source of truth (no TVM PagedKVCache object). Per layer, `k_pool` and
`v_pool` are `[num_blocks, block_size, kv_heads, head_dim]`; a step packs S sequences' new tokens into N rows,
`query_start [S + 1]` says which rows are whose, `past_lens [S]` how many tokens each already has, and
`block_tables [S, max_blocks]` where position p of sequence s lives: block `block_tables[s, p // block_size]`,
offset `p % block_size`. N, S, max_blocks and num_blocks are symbolic; table entries past a sequence's last
block are never read. Every loop is bounded by the row's own sequence (causal, optionally a sliding window or
a local chunk), never by the pool, and softmax is online in float32 whatever the dtype. MLA's latent cache (one kv
head, the latent in k_pool and the rotary key in v_pool) is attended by the same kernel, its keys read from both
pools.

In-place pools: the append (and the block copy) are `relax.call_tir_inplace` on the pool parameters of the
Relax function, so the VM writes into the caller's tensors; TVM 0.27's pipeline (LegalizeOps, FuseOps/FuseTIR,
DLight, memory planning) leaves such calls as they are. The attention reads the in-place call's outputs, which
both orders it after the append and keeps the append alive through dead-code elimination; `emit_copy_blocks`'s
result must likewise be used (e.g. returned). The pools must be passed as `tvm.runtime.Tensor`s on the VM's
device (a numpy array would be converted to a fresh tensor, and the update lost).

The kernel builders are cached by their arguments: TVMScript takes ~0.4 s to parse a kernel, and a model's layers
share one kernel per shape (SmolLM2's 30 layers parsed 60 kernels: half its compile time).
"""

from __future__ import annotations

import functools
import math
import operator

import numpy as np
from tvm import DataType, relax, te, tirx
from tvm.script import tirx as T
from tvm.target import Target

from .cpu_schedule import LANES, float_lanes  # LANES: float32 partial sums per dot product on CPU (one AVX2 register)
from .lane_tree import buffer_tree
from .prefetch import LINE_BYTES, prefetch
from .row_loop import over_rows

NEG = -1e30  # a finite minus infinity: exp(NEG - m) is 0 and NEG - NEG is no NaN
CUDA_THREADS = 64  # threads per CUDA thread block (and positions per attention tile)
TILE_QUERIES = 64  # CPU: query vectors (rows x query heads of a kv head) a prompt chunk's tile attends at once
SPLIT_TASKS = 16  # CPU: a call with fewer (row, kv head) tasks splits each decode row's keys into ranges up to this
SPLIT_BLOCKS = 8  # blocks of keys a range of the call's longest row takes at least (fewer: fixed costs outweigh it)
# scheduled already (DLight skips them) and opaque to FuseOps (op_pattern kOpaque), which would otherwise take
# the block copy for an elementwise op
ATTRS = {"tirx.is_scheduled": True, "tirx.noalias": True, "op_pattern": 8}


def _is_cuda(target_kind: str) -> bool:
    """Whether the kernels bind CUDA threads (`cuda`) or run parallel CPU loops (`llvm`)."""
    if target_kind not in ("llvm", "cuda"):
        raise ValueError(f"paged kernels are written for llvm and cuda, not {target_kind!r}")
    return target_kind == "cuda"


def _quantized(pool_dtype: str, target_kind: str) -> bool:
    """Whether the pools hold int8 steps of a scale (the CPU kernels only: the CUDA ones read float pools)."""
    if pool_dtype != "int8":
        return False
    if _is_cuda(target_kind):
        raise ValueError("int8 KV pools: the paged kernels take them on the CPU (llvm) only")
    return True


@T.macro
def _sequence_of(seq: T.Buffer, query_start: T.Buffer, num_seqs: T.int32, row: T.int32) -> None:
    """seq[0] = the sequence owning `row`: the last s with query_start[s] <= row (sequences without new rows
    share their start with the next one, which then wins)."""
    seq[0] = 0
    for s in T.serial(num_seqs):
        if query_start[s] <= row:
            seq[0] = s


def _interleaved(slot: tirx.PrimExpr, count: tirx.PrimExpr) -> tirx.PrimExpr:
    """The item of `count` a parallel loop's slot takes: the first, the last, the second, the second to last... TVM
    hands each thread an equal run of slots, so each run holds as many early items as late ones: a prompt chunk's
    causal rows cost in proportion to their position, and in order the last thread would take most of the work."""
    return T.if_then_else(slot % 2 == 0, slot // 2, count - 1 - slot // 2)


def _rows_in_tile(query_start: T.Buffer, seq: T.Buffer, offset: tirx.PrimExpr, tile_rows: int) -> tirx.PrimExpr:
    """Rows of the CPU kernel's prompt tile that holds row `offset` of sequence seq[0]'s new rows (1: a decode row,
    or a chunk's last alone in its tile)."""
    lead = offset - offset % tile_rows  # the first row of the tile
    return T.min(tile_rows, query_start[seq[0] + 1] - query_start[seq[0]] - lead)


def _to_int8(x: tirx.PrimExpr, scale: tirx.PrimExpr) -> tirx.PrimExpr:
    """x as an int8 step of `scale`: rounded, saturated to [-128, 127] (ir/attention.py's quantize_kv)."""
    steps = T.round(T.Cast("float32", x) / scale)
    return T.Cast("int8", T.max(T.min(steps, T.float32(127.0)), T.float32(-128.0)))


def vector_exp(x: tirx.PrimExpr) -> tirx.PrimExpr:
    """exp(x) for float32 in plain arithmetic, so that a vectorized loop stays in vector lanes (LLVM calls libm's
    scalar expf per lane): x = n ln2 + r with |r| <= ln2 / 2, e^r by its Taylor series to r^7 (relative error
    < 1e-7), times 2^n built in the exponent bits. x is clamped to [-88, 88]; below 2^-126 the result is 0, so
    exp(NEG - m) is exactly 0 as with libm."""
    x = T.max(T.min(x, T.float32(88.0)), T.float32(-88.0))
    n = T.floor(x * T.float32(1.4426950408889634) + T.float32(0.5))
    r = x - n * T.float32(0.693359375) + n * T.float32(2.12194440e-4)  # ln 2 in two parts (Cody-Waite)
    poly = T.float32(1.0 / 5040)
    for k in (720, 120, 24, 6, 2, 1, 1):
        poly = poly * r + T.float32(1.0 / k)
    bits = T.shift_left(T.Cast("int32", n) + 127, 23)
    return poly * T.reinterpret("float32", T.if_then_else(n < T.float32(-126.0), 0, bits))


@T.macro
def _dot_lanes(
    part: T.Buffer,
    q_s: T.Buffer,
    start: int,
    pool: T.Buffer,
    block: T.int32,
    t: T.int32,
    kvh: T.int32,
    width: int,
    group: int,
    lanes: int,
) -> None:
    """part[g, t, lane] += q_s[g, start:start + width] · pool[block, t, kvh, :width] for each query head g of the
    group, in `lanes` partial sums (the CPU kernel's key t)."""
    for c in T.unroll(width // lanes):
        for g in T.unroll(group):
            for lane in T.vectorized(lanes):
                part[g, t, lane] += q_s[g, start + c * lanes + lane] * T.Cast(
                    "float32", pool[block, t, kvh, c * lanes + lane]
                )


def _sum_keys(part: tirx.Buffer, score: tirx.Buffer, g: tirx.PrimExpr, first: tirx.PrimExpr, keys: int) -> None:
    """score[g, first + t] = the sum of part[g, first + t, :] for the `keys` keys from `first`, their partial sums'
    lanes reduced together in vector registers: each key's lanes halved down to `keys` lanes, then pairs of vectors
    shuffled into one whose lanes hold half of each's (a stage halves the vectors and their partial sums), so the
    keys end in one vector, key t in lane t, after keys - 1 adds instead of a horizontal sum per key."""
    lanes = int(part.shape[2])
    vectors = [part[g, first + t, T.ramp(0, 1, lanes)] for t in range(keys)]
    while lanes > keys:  # a key's partial sums halved
        lanes //= 2
        vectors = [T.Shuffle([v], list(range(lanes))) + T.Shuffle([v], list(range(lanes, 2 * lanes))) for v in vectors]
    width = keys // 2
    while len(vectors) > 1:
        half = len(vectors) // 2
        low, high = _key_lanes(keys, width)
        vectors = [
            T.Shuffle([vectors[i], vectors[i + half]], low) + T.Shuffle([vectors[i], vectors[i + half]], high)
            for i in range(half)
        ]
        width //= 2
    T.buffer_store(score, vectors[0], [g, T.ramp(first, 1, keys)])


def _key_lanes(keys: int, width: int) -> tuple[list[int], list[int]]:
    """A stage of _sum_keys over vectors a, b (`keys` lanes, concatenated): in each run of 2 x width lanes, the
    first width lanes of the sum get a's halves of its run, the rest b's."""
    low, high = [], []
    for lane in range(keys):
        run, within = divmod(lane, 2 * width)
        source = run * 2 * width + within + (keys - width if within >= width else 0)
        low.append(source)
        high.append(source + width)
    return low, high


@T.macro
def _prefetch_row(pool: T.Buffer, block: T.int32, t: T.int32, kvh: T.int32, width: int, line_elems: int) -> None:
    """Asks the caches for pool[block, t, kvh, :width] ahead of reading it: a kv head's rows in a block are short
    runs a whole position apart, a stride the hardware prefetchers follow too late for one decode row's walk."""
    for line in T.unroll(-(-width // line_elems)):
        T.evaluate(prefetch(pool[block, t, kvh, line * line_elems]))


@T.macro
def _dot(
    dot: T.Buffer, q_s: T.Buffer, start: int, pool: T.Buffer, block: T.int32, offset: T.int32, kvh: T.int32, width: int
) -> None:
    """dot[0] += q_s[start:start + width] · pool[block, offset, kvh, :width] (a CUDA thread's key)."""
    for d in T.serial(width):
        dot[0] += q_s[start + d] * T.Cast("float32", pool[block, offset, kvh, d])


@functools.cache
def append_kernel(
    kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: str,
    target_kind: str,
    value_head_dim: int | None = None,
    pool_dtype: str | None = None,
) -> tirx.PrimFunc:
    """k/v of every row written into the pools at the row's position, in place (pools are the first two
    arguments): one task per row. Values may have a head size of their own (value_head_dim). int8 pools (CPU)
    take round(x / scale) saturated to [-128, 127], with the k_scale / v_scale arguments [kv_heads, head_dim]
    (float32, read only then); float pools of another dtype than k and v's (a float32 model's float16 cache) take
    them cast."""
    dv = value_head_dim or head_dim
    row_elems = kv_heads * max(head_dim, dv)
    pool_dtype = pool_dtype or dtype
    quantized = _quantized(pool_dtype, target_kind)

    @T.macro
    def appended_row(row, k_pool, v_pool, k, v, block_tables, past_lens, query_start, num_seqs, k_scale, v_scale):
        with T.sblock("append"):
            T.reads()
            T.writes()
            seq = T.sblock_alloc_buffer((1,), "int32")
            _sequence_of(seq, query_start, num_seqs, row)
            pos: T.let[T.int32] = past_lens[seq[0]] + row - query_start[seq[0]]
            block: T.let[T.int32] = block_tables[seq[0], pos // block_size]
            for h in T.serial(kv_heads):
                if quantized:
                    for d in T.serial(head_dim):
                        k_pool[block, pos % block_size, h, d] = _to_int8(k[row, h, d], k_scale[h, d])
                    for d in T.serial(dv):
                        v_pool[block, pos % block_size, h, d] = _to_int8(v[row, h, d], v_scale[h, d])
                else:
                    for d in T.vectorized(head_dim):
                        k_pool[block, pos % block_size, h, d] = T.Cast(pool_dtype, k[row, h, d])
                    for d in T.vectorized(dv):
                        v_pool[block, pos % block_size, h, d] = T.Cast(pool_dtype, v[row, h, d])

    @T.prim_func(s_tir=True, private=True)
    def paged_append(
        k_pool_h: T.handle,
        v_pool_h: T.handle,
        k_h: T.handle,
        v_h: T.handle,
        tables_h: T.handle,
        past_h: T.handle,
        starts_h: T.handle,
        k_scale_h: T.handle,
        v_scale_h: T.handle,
    ):
        T.func_attr(ATTRS)
        n, num_seqs, max_blocks, num_blocks = T.int32(), T.int32(), T.int32(), T.int64()
        k_pool = T.match_buffer(k_pool_h, (num_blocks, block_size, kv_heads, head_dim), pool_dtype)
        v_pool = T.match_buffer(v_pool_h, (num_blocks, block_size, kv_heads, dv), pool_dtype)
        k = T.match_buffer(k_h, (n, kv_heads, head_dim), dtype)
        v = T.match_buffer(v_h, (n, kv_heads, dv), dtype)
        block_tables = T.match_buffer(tables_h, (num_seqs, max_blocks), "int32")
        past_lens = T.match_buffer(past_h, (num_seqs,), "int32")
        query_start = T.match_buffer(starts_h, (num_seqs + 1,), "int32")
        k_scale = T.match_buffer(k_scale_h, (kv_heads, head_dim), "float32")
        v_scale = T.match_buffer(v_scale_h, (kv_heads, dv), "float32")
        if _is_cuda(target_kind):
            for row in T.thread_binding(n, thread="blockIdx.x"):
                for tx in T.thread_binding(CUDA_THREADS, thread="threadIdx.x"):
                    with T.sblock("append"):
                        T.reads()
                        T.writes()
                        seq = T.sblock_alloc_buffer((1,), "int32", scope="local")
                        _sequence_of(seq, query_start, num_seqs, row)
                        pos: T.let[T.int32] = past_lens[seq[0]] + row - query_start[seq[0]]
                        block: T.let[T.int32] = block_tables[seq[0], pos // block_size]
                        for i in T.serial(T.ceildiv(row_elems, CUDA_THREADS)):
                            e: T.let[T.int32] = i * CUDA_THREADS + tx
                            if e < kv_heads * head_dim:
                                k_pool[block, pos % block_size, e // head_dim, e % head_dim] = T.Cast(
                                    pool_dtype, k[row, e // head_dim, e % head_dim]
                                )
                            if e < kv_heads * dv:
                                v_pool[block, pos % block_size, e // dv, e % dv] = T.Cast(
                                    pool_dtype, v[row, e // dv, e % dv]
                                )
        else:
            over_rows(
                n,
                appended_row,
                (k_pool, v_pool, k, v, block_tables, past_lens, query_start, num_seqs, k_scale, v_scale),
            )

    return paged_append


@functools.cache
def attention_kernel(
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: str,
    scale: float,
    window: int,
    target_kind: str,
    softcap: float = 0.0,
    sinks: bool = False,
    value_head_dim: int | None = None,
    alibi: bool = False,
    latent: bool = False,
    pool_dtype: str | None = None,
    vector_lanes: int = LANES,
) -> tirx.PrimFunc:
    """out[row, h] = softmax(scale * q·K) · V over the row's own positions lo..pos (lo = pos - window + 1 with a
    sliding window, the start of pos's chunk with chunked local attention (window < 0), else 0). CPU: one task per
    (row, kv head), each pass over a key serving its query heads, whose dot products run in vector-wide partial sums
    that a block's keys then reduce together (_sum_keys); a prompt chunk's rows are taken prefill_tile_rows at a
    time instead (one task per tile and kv head), so that each key is read once for the tile's rows x query heads,
    whose scores run in vector lanes (q transposed); a row alone in its tile (a decode row) keeps the one-row path.
    With fewer than SPLIT_TASKS tasks (a few decode rows: SmolLM2's 3 kv heads would leave one of 2 threads idle a
    third of the time), each decode row's blocks are split into ranges attended as tasks of their own, whose partial
    softmaxes are then merged.
    CUDA: one thread block per (row, head), CUDA_THREADS positions per tile. The extras of ir/attention.py:
    softcap > 0 caps each logit at softcap * tanh(logit / softcap); with `sinks`, head h's sink logit sinks[h]
    (the kernel's sinks argument, [heads] float32, read only then) starts the online softmax as a key with no
    value (running max sinks[h], sum 1), which is the extra softmax column transformers drops; values may have
    a head size of their own (value_head_dim); with `alibi`, head h adds slopes[h] * (j - pos) to the logit of
    position j (the slopes argument, [heads] float32, read only then), after the softcap. With `latent` (MLA's
    latent cache, ir/latent_attention.py) the keys continue into v_pool, [k_pool | v_pool] (the latent, then the
    rotary key: q is head_dim + value_head_dim wide), and the values are k_pool's (out head_dim wide). int8 pools
    (CPU) hold steps of k_scale / v_scale [kv_heads, head_dim] (float32 arguments, read only then), folded in
    where it costs least: q times k_scale once per row before the dot products, the output times v_scale after."""
    group = heads // kv_heads
    pool_dtype = pool_dtype or dtype
    quantized = _quantized(pool_dtype, target_kind)
    dv = value_head_dim or head_dim
    key_dim, value_dim = (head_dim + dv, head_dim) if latent else (head_dim, dv)
    lanes = math.gcd(head_dim, key_dim, vector_lanes)  # a decode row's partial sums per key
    key_run = min(lanes, block_size)  # keys whose partial sums are reduced together
    dims_per_thread = -(-key_dim // CUDA_THREADS)
    value_dims_per_thread = -(-value_dim // CUDA_THREADS)
    tile_rows = prefill_tile_rows(group)
    queries = tile_rows * group  # a tile's query vectors: its rows' query heads of one kv head
    tile_lanes = math.gcd(queries, vector_lanes)  # a tile's loops over its queries run in vectors this wide,
    chunks = queries // tile_lanes  # this many of them
    key_step, value_step = math.gcd(block_size, 4), math.gcd(value_dim, 4)  # keys / value dimensions at once
    line_elems = LINE_BYTES * 8 // DataType(pool_dtype).bits  # pool elements in a cache line

    def capped(score):  # noqa: ANN001, ANN202 (a TIR expression)
        """softcap * tanh(score / softcap)."""
        return T.tanh(score * T.float32(1.0 / softcap)) * T.float32(softcap)

    def tile_logit(score, slope_v, t, t_lo, t_hi, j, pos):  # noqa: ANN001, ANN202 (TIR expressions)
        """The logit of a tile's query at key j (the query row at position pos): capped, ALiBi's bias added; NEG
        outside the block's keys [t_lo, t_hi), after pos or before the row's window."""
        if softcap > 0:
            score = capped(score)
        if alibi:
            score = score + slope_v * T.Cast("float32", j - pos)
        valid = tirx.all(t_lo <= t, t < t_hi, j <= pos, *([first_key(pos) <= j] if window else []))
        return T.if_then_else(valid, score, T.float32(NEG))

    def first_key(pos):  # noqa: ANN001, ANN202 (a TIR expression)
        """The first position a query at `pos` sees: its sliding window's (window > 0), its chunk's (window < 0,
        chunked local attention), else 0."""
        if window > 0:
            return T.max(pos - window + 1, 0)
        return pos - T.floormod(pos, -window) if window < 0 else 0

    @T.prim_func(s_tir=True, private=True)
    def paged_attention(
        q_h: T.handle,
        k_pool_h: T.handle,
        v_pool_h: T.handle,
        tables_h: T.handle,
        past_h: T.handle,
        starts_h: T.handle,
        sinks_h: T.handle,
        slopes_h: T.handle,
        k_scale_h: T.handle,
        v_scale_h: T.handle,
        out_h: T.handle,
    ):
        T.func_attr(ATTRS)
        n, num_seqs, max_blocks, num_blocks = T.int32(), T.int32(), T.int32(), T.int64()
        q = T.match_buffer(q_h, (n, heads, key_dim), dtype)
        k_pool = T.match_buffer(k_pool_h, (num_blocks, block_size, kv_heads, head_dim), pool_dtype)
        v_pool = T.match_buffer(v_pool_h, (num_blocks, block_size, kv_heads, dv), pool_dtype)
        k_scale = T.match_buffer(k_scale_h, (kv_heads, head_dim), "float32")
        v_scale = T.match_buffer(v_scale_h, (kv_heads, dv), "float32")
        block_tables = T.match_buffer(tables_h, (num_seqs, max_blocks), "int32")
        past_lens = T.match_buffer(past_h, (num_seqs,), "int32")
        query_start = T.match_buffer(starts_h, (num_seqs + 1,), "int32")
        sink = T.match_buffer(sinks_h, (heads,), "float32")
        slope = T.match_buffer(slopes_h, (heads,), "float32")
        out = T.match_buffer(out_h, (n, heads, value_dim), dtype)
        values = k_pool if latent else v_pool
        if _is_cuda(target_kind):
            for task in T.thread_binding(n * heads, thread="blockIdx.x"):
                for tx in T.thread_binding(CUDA_THREADS, thread="threadIdx.x"):
                    with T.sblock("attention"):
                        T.reads()
                        T.writes()
                        q_s = T.sblock_alloc_buffer((key_dim,), "float32", scope="shared")
                        score = T.sblock_alloc_buffer((CUDA_THREADS,), "float32", scope="shared")
                        block_of = T.sblock_alloc_buffer((CUDA_THREADS,), "int32", scope="shared")
                        seq = T.sblock_alloc_buffer((1,), "int32", scope="local")
                        acc = T.sblock_alloc_buffer((value_dims_per_thread,), "float32", scope="local")
                        dot = T.sblock_alloc_buffer((1,), "float32", scope="local")
                        m = T.sblock_alloc_buffer((1,), "float32", scope="local")
                        m_new = T.sblock_alloc_buffer((1,), "float32", scope="local")
                        alpha = T.sblock_alloc_buffer((1,), "float32", scope="local")
                        total = T.sblock_alloc_buffer((1,), "float32", scope="local")
                        row: T.let[T.int32] = task // heads
                        h: T.let[T.int32] = task % heads
                        _sequence_of(seq, query_start, num_seqs, row)
                        pos: T.let[T.int32] = past_lens[seq[0]] + row - query_start[seq[0]]
                        lo: T.let[T.int32] = first_key(pos)
                        m[0] = sink[h] if sinks else T.float32(NEG)
                        total[0] = T.float32(1.0) if sinks else T.float32(0.0)
                        for i in T.serial(value_dims_per_thread):
                            acc[i] = 0.0
                        for i in T.serial(dims_per_thread):
                            if i * CUDA_THREADS + tx < key_dim:
                                q_s[i * CUDA_THREADS + tx] = T.Cast("float32", q[row, h, i * CUDA_THREADS + tx]) * scale
                        T.tvm_storage_sync("shared")
                        for tile in T.serial(T.ceildiv(pos - lo + 1, CUDA_THREADS)):
                            j: T.let[T.int32] = lo + tile * CUDA_THREADS + tx
                            dot[0] = NEG
                            if j <= pos:
                                block_of[tx] = block_tables[seq[0], j // block_size]
                                dot[0] = 0.0
                                _dot(dot, q_s, 0, k_pool, block_of[tx], j % block_size, h // group, head_dim)
                                if latent:
                                    _dot(dot, q_s, head_dim, v_pool, block_of[tx], j % block_size, h // group, dv)
                                if softcap > 0:
                                    dot[0] = capped(dot[0])
                                if alibi:
                                    dot[0] += slope[h] * T.Cast("float32", j - pos)
                            score[tx] = dot[0]
                            T.tvm_storage_sync("shared")
                            m_new[0] = m[0]
                            for t in T.serial(CUDA_THREADS):
                                m_new[0] = T.max(m_new[0], score[t])
                            T.tvm_storage_sync("shared")
                            score[tx] = T.exp(dot[0] - m_new[0])
                            T.tvm_storage_sync("shared")
                            alpha[0] = T.exp(m[0] - m_new[0])
                            total[0] *= alpha[0]
                            for i in T.serial(value_dims_per_thread):
                                acc[i] *= alpha[0]
                            m[0] = m_new[0]
                            for t in T.serial(T.min(CUDA_THREADS, pos - lo + 1 - tile * CUDA_THREADS)):
                                total[0] += score[t]
                                for i in T.serial(value_dims_per_thread):
                                    if i * CUDA_THREADS + tx < value_dim:
                                        acc[i] += score[t] * T.Cast(
                                            "float32",
                                            values[
                                                block_of[t],
                                                (lo + tile * CUDA_THREADS + t) % block_size,
                                                h // group,
                                                i * CUDA_THREADS + tx,
                                            ],
                                        )
                            T.tvm_storage_sync("shared")
                        for i in T.serial(value_dims_per_thread):
                            if i * CUDA_THREADS + tx < value_dim:
                                out[row, h, i * CUDA_THREADS + tx] = T.Cast(dtype, acc[i] / total[0])
        else:
            longest = T.alloc_buffer((1,), "int32")  # the most keys a row of the call attends
            longest[0] = 0
            for s in T.serial(num_seqs):
                longest[0] = T.max(longest[0], past_lens[s] + query_start[s + 1] - query_start[s])
            if window != 0:
                longest[0] = T.min(longest[0], abs(window) + block_size)
            splits: T.int32 = T.max(  # key ranges of a decode row, each at least SPLIT_BLOCKS of the longest's
                T.min(SPLIT_TASKS // T.max(n * kv_heads, 1), longest[0] // (SPLIT_BLOCKS * block_size)), 1
            )
            # each range's output, softmax max and sum (a task's with splits > 1: n x kv_heads x splits <= SPLIT_TASKS)
            partial = T.alloc_buffer((SPLIT_TASKS, group, value_dim + 2), "float32")
            for slot in T.parallel(n * kv_heads * splits):
                with T.sblock("attention"):
                    T.reads()
                    T.writes()
                    seq = T.sblock_alloc_buffer((1,), "int32")
                    q_s = T.sblock_alloc_buffer((group, key_dim), "float32")
                    acc = T.sblock_alloc_buffer((group, value_dim), "float32")
                    score = T.sblock_alloc_buffer((group, block_size), "float32")
                    m = T.sblock_alloc_buffer((group,), "float32")
                    m_new = T.sblock_alloc_buffer((group,), "float32")
                    alpha = T.sblock_alloc_buffer((group,), "float32")
                    part = T.sblock_alloc_buffer((group, block_size, lanes), "float32")
                    total = T.sblock_alloc_buffer((group, block_size), "float32")  # the softmax's sums, by key slot
                    # rows interleaved, a row's tasks kept together (its kv heads' keys are neighbours in memory);
                    # the row goes through a local so that the simplifier does not carry the interleaving's branch
                    # into every index below (that made the kernel's build 4-6x slower)
                    row_of = T.sblock_alloc_buffer((1,), "int32")
                    row_of[0] = _interleaved(slot // (kv_heads * splits), n)
                    row: T.let[T.int32] = row_of[0]
                    task: T.let[T.int32] = row * kv_heads * splits + slot % (kv_heads * splits)
                    kvh: T.let[T.int32] = task // splits % kv_heads
                    split: T.let[T.int32] = task % splits  # the range of a decode row's keys this task takes
                    _sequence_of(seq, query_start, num_seqs, row)
                    offset: T.let[T.int32] = row - query_start[seq[0]]
                    lead: T.let[T.int32] = offset - offset % tile_rows  # the first row of this row's tile
                    rows: T.let[T.int32] = _rows_in_tile(query_start, seq, offset, tile_rows)
                    pos: T.let[T.int32] = past_lens[seq[0]] + offset
                    lo: T.let[T.int32] = first_key(pos)
                    per_split: T.let[T.int32] = T.ceildiv(pos // block_size + 1 - lo // block_size, splits)
                    b_lo: T.let[T.int32] = lo // block_size + split * per_split  # this task's blocks
                    b_hi: T.let[T.int32] = T.min(b_lo + per_split, pos // block_size + 1)
                    if rows == 1 and b_lo >= b_hi:  # a range past the row's last block: nothing to merge
                        for g in T.serial(group):
                            partial[task, g, value_dim + 1] = T.float32(0.0)
                    elif rows == 1:  # a decode row (or a chunk's last, alone in its tile)
                        for g in T.serial(group):
                            m[g] = T.float32(NEG)
                            if sinks and split == 0:
                                m[g] = sink[kvh * group + g]
                            for t in T.vectorized(block_size):
                                total[g, t] = T.float32(0.0)
                            if sinks and split == 0:
                                total[g, 0] = T.float32(1.0)
                            for d in T.vectorized(key_dim):
                                q_s[g, d] = T.Cast("float32", q[row, kvh * group + g, d]) * scale
                            if quantized:
                                for d in T.vectorized(key_dim):
                                    q_s[g, d] = q_s[g, d] * k_scale[kvh, d]
                            for d in T.vectorized(value_dim):
                                acc[g, d] = 0.0
                        for b in T.serial(b_lo, b_hi):
                            block: T.let[T.int32] = block_tables[seq[0], b]
                            # the next block's keys and values, a position per key of this one (a burst of them
                            # all would wait on the cache's few outstanding misses)
                            ahead: T.let[T.int32] = block_tables[seq[0], T.min(b + 1, pos // block_size)]
                            for t in T.serial(block_size):  # every slot's dot (outside lo..pos masked below)
                                if b < pos // block_size:
                                    _prefetch_row(k_pool, ahead, t, kvh, head_dim, line_elems)
                                    _prefetch_row(v_pool, ahead, t, kvh, dv, line_elems)
                                for g in T.unroll(group):
                                    for lane in T.vectorized(lanes):
                                        part[g, t, lane] = 0.0
                                _dot_lanes(part, q_s, 0, k_pool, block, t, kvh, head_dim, group, lanes)
                                if latent:
                                    _dot_lanes(part, q_s, head_dim, v_pool, block, t, kvh, dv, group, lanes)
                            for g in T.unroll(group):
                                for run in T.unroll(block_size // key_run):
                                    _sum_keys(part, score, g, run * key_run, key_run)
                                for t in T.vectorized(block_size):
                                    j = T.meta_var(b * block_size + t)
                                    if softcap > 0:
                                        score[g, t] = capped(score[g, t])
                                    if alibi:
                                        score[g, t] += slope[kvh * group + g] * T.Cast("float32", j - pos)
                                    score[g, t] = T.if_then_else(tirx.all(lo <= j, j <= pos), score[g, t], NEG)
                            for g in T.serial(group):
                                m_new[g] = T.max(m[g], buffer_tree(T.max, score, (g,), block_size))
                                alpha[g] = vector_exp(m[g] - m_new[g])
                                for d in T.vectorized(value_dim):
                                    acc[g, d] *= alpha[g]
                                m[g] = m_new[g]
                                for t in T.vectorized(block_size):
                                    score[g, t] = vector_exp(score[g, t] - m[g])
                                    total[g, t] = total[g, t] * alpha[g] + score[g, t]
                            for t in T.serial(block_size):
                                if lo <= b * block_size + t and b * block_size + t <= pos:
                                    for g in T.serial(group):
                                        for d in T.vectorized(value_dim):
                                            acc[g, d] += score[g, t] * T.Cast("float32", values[block, t, kvh, d])
                        for g in T.serial(group):
                            if quantized:
                                for d in T.vectorized(value_dim):
                                    acc[g, d] = acc[g, d] * v_scale[kvh, d]
                            denominator: T.let[T.float32] = buffer_tree(operator.add, total, (g,), block_size)
                            if splits == 1:
                                for d in T.vectorized(value_dim):
                                    out[row, kvh * group + g, d] = T.Cast(dtype, acc[g, d] / denominator)
                            else:
                                for d in T.vectorized(value_dim):
                                    partial[task, g, d] = acc[g, d]
                                partial[task, g, value_dim] = m[g]
                                partial[task, g, value_dim + 1] = denominator

                    elif offset == lead and split == 0:  # a prompt chunk's tile: its rows' query heads take every key
                        with T.sblock("tile"):
                            T.reads()
                            T.writes()
                            qt = T.sblock_alloc_buffer((key_dim, queries), "float32")
                            s_t = T.sblock_alloc_buffer((block_size, queries), "float32")
                            acc_t = T.sblock_alloc_buffer((value_dim, queries), "float32")
                            m_t = T.sblock_alloc_buffer((queries,), "float32")
                            m_new_t = T.sblock_alloc_buffer((queries,), "float32")
                            alpha_t = T.sblock_alloc_buffer((queries,), "float32")
                            total_t = T.sblock_alloc_buffer((queries,), "float32")
                            pos_t = T.sblock_alloc_buffer((queries,), "int32")  # each query's row position
                            slope_t = T.sblock_alloc_buffer((queries,), "float32")  # and its head's ALiBi slope
                            first: T.let[T.int32] = past_lens[seq[0]] + offset  # the tile's first position
                            last: T.let[T.int32] = first + rows - 1
                            lo_t: T.let[T.int32] = first_key(first)
                            for v in T.serial(queries):  # q transposed: a key's value scales every query
                                if v // group < rows:  # each query's row of q read whole, a vector at a time
                                    for d in T.vectorized(key_dim):
                                        qt[d, v] = (
                                            T.Cast("float32", q[row + v // group, kvh * group + v % group, d]) * scale
                                        )
                                        if quantized:
                                            qt[d, v] = qt[d, v] * k_scale[kvh, d]
                                else:
                                    for d in T.vectorized(key_dim):
                                        qt[d, v] = T.float32(0.0)
                            for v in T.serial(queries):
                                m_t[v] = sink[kvh * group + v % group] if sinks else T.float32(NEG)
                                total_t[v] = T.float32(1.0) if sinks else T.float32(0.0)
                                pos_t[v] = first + v // group
                                slope_t[v] = slope[kvh * group + v % group] if alibi else T.float32(0.0)
                            for d, v in T.grid(value_dim, queries):
                                acc_t[d, v] = T.float32(0.0)
                            for b in T.serial(lo_t // block_size, last // block_size + 1):
                                block: T.let[T.int32] = block_tables[seq[0], b]
                                t_lo: T.let[T.int32] = T.max(lo_t - b * block_size, 0)
                                t_hi: T.let[T.int32] = T.min(last - b * block_size + 1, block_size)
                                # every key of the block, key_step at once (independent sums in registers); those
                                # outside [t_lo, t_hi) are masked below, so whatever their slots hold is never used
                                for t_step in T.serial(block_size // key_step):
                                    for k, c in T.grid(key_step, chunks):
                                        for lane in T.vectorized(tile_lanes):
                                            s_t[t_step * key_step + k, c * tile_lanes + lane] = T.float32(0.0)
                                    for d in T.serial(head_dim):
                                        for k in T.unroll(key_step):
                                            for c in T.unroll(chunks):
                                                for lane in T.vectorized(tile_lanes):
                                                    t = T.meta_var(t_step * key_step + k)
                                                    v = T.meta_var(c * tile_lanes + lane)
                                                    s_t[t, v] += qt[d, v] * T.Cast("float32", k_pool[block, t, kvh, d])
                                    if latent:
                                        for d in T.serial(dv):
                                            for k in T.unroll(key_step):
                                                for c in T.unroll(chunks):
                                                    for lane in T.vectorized(tile_lanes):
                                                        t = T.meta_var(t_step * key_step + k)
                                                        v = T.meta_var(c * tile_lanes + lane)
                                                        s_t[t, v] += qt[head_dim + d, v] * T.Cast(
                                                            "float32", v_pool[block, t, kvh, d]
                                                        )
                                for t in T.serial(block_size):
                                    j: T.let[T.int32] = b * block_size + t
                                    for c in T.unroll(chunks):
                                        for lane in T.vectorized(tile_lanes):
                                            v = T.meta_var(c * tile_lanes + lane)
                                            s_t[t, v] = tile_logit(s_t[t, v], slope_t[v], t, t_lo, t_hi, j, pos_t[v])
                                for c in T.unroll(chunks):
                                    for lane in T.vectorized(tile_lanes):
                                        v = T.meta_var(c * tile_lanes + lane)
                                        m_new_t[v] = m_t[v]
                                for t in T.serial(block_size):
                                    for c in T.unroll(chunks):
                                        for lane in T.vectorized(tile_lanes):
                                            v = T.meta_var(c * tile_lanes + lane)
                                            m_new_t[v] = T.max(m_new_t[v], s_t[t, v])
                                for c in T.unroll(chunks):
                                    for lane in T.vectorized(tile_lanes):
                                        v = T.meta_var(c * tile_lanes + lane)
                                        alpha_t[v] = vector_exp(m_t[v] - m_new_t[v])
                                        total_t[v] *= alpha_t[v]
                                        m_t[v] = m_new_t[v]
                                for d in T.serial(value_dim):
                                    for c in T.unroll(chunks):
                                        for lane in T.vectorized(tile_lanes):
                                            v = T.meta_var(c * tile_lanes + lane)
                                            acc_t[d, v] *= alpha_t[v]
                                for t in T.serial(block_size):
                                    for c in T.unroll(chunks):
                                        for lane in T.vectorized(tile_lanes):
                                            v = T.meta_var(c * tile_lanes + lane)
                                            s_t[t, v] = vector_exp(s_t[t, v] - m_t[v])
                                            total_t[v] += s_t[t, v]
                                for d_step in T.serial(value_dim // value_step):  # value_step dimensions at once
                                    for t in T.serial(t_lo, t_hi):  # the block's keys only: other slots may be NaN
                                        for e in T.unroll(value_step):
                                            for c in T.unroll(chunks):
                                                for lane in T.vectorized(tile_lanes):
                                                    d = T.meta_var(d_step * value_step + e)
                                                    v = T.meta_var(c * tile_lanes + lane)
                                                    acc_t[d, v] += s_t[t, v] * T.Cast(
                                                        "float32", values[block, t, kvh, d]
                                                    )
                            for v in T.serial(queries):
                                if v // group < rows:
                                    for d in T.serial(value_dim):
                                        out[row + v // group, kvh * group + v % group, d] = T.Cast(
                                            dtype,
                                            acc_t[d, v]
                                            / total_t[v]
                                            * (v_scale[kvh, d] if quantized else T.float32(1.0)),
                                        )
            if splits > 1:  # each decode row's ranges merged: outputs and sums rescaled to the ranges' largest max
                for task in T.serial(n * kv_heads):
                    with T.sblock("merge"):
                        T.reads()
                        T.writes()
                        seq = T.sblock_alloc_buffer((1,), "int32")
                        merged = T.sblock_alloc_buffer((value_dim,), "float32")
                        top = T.sblock_alloc_buffer((1,), "float32")
                        weight = T.sblock_alloc_buffer((1,), "float32")
                        denominator = T.sblock_alloc_buffer((1,), "float32")
                        row: T.let[T.int32] = task // kv_heads
                        kvh: T.let[T.int32] = task % kv_heads
                        _sequence_of(seq, query_start, num_seqs, row)
                        if _rows_in_tile(query_start, seq, row - query_start[seq[0]], tile_rows) == 1:
                            for g in T.serial(group):
                                top[0] = T.float32(NEG)
                                denominator[0] = T.float32(0.0)
                                for d in T.vectorized(value_dim):
                                    merged[d] = T.float32(0.0)
                                for s in T.serial(splits):
                                    if partial[task * splits + s, g, value_dim + 1] > T.float32(0.0):
                                        top[0] = T.max(top[0], partial[task * splits + s, g, value_dim])
                                for s in T.serial(splits):
                                    if partial[task * splits + s, g, value_dim + 1] > T.float32(0.0):
                                        weight[0] = T.exp(partial[task * splits + s, g, value_dim] - top[0])
                                        denominator[0] += weight[0] * partial[task * splits + s, g, value_dim + 1]
                                        for d in T.vectorized(value_dim):
                                            merged[d] += weight[0] * partial[task * splits + s, g, d]
                                for d in T.vectorized(value_dim):
                                    out[row, kvh * group + g, d] = T.Cast(dtype, merged[d] / denominator[0])

    return paged_attention


def prefill_tile_rows(group: int) -> int:
    """Rows of a prompt chunk the CPU attention takes at once: a power of two with rows x query heads per kv head
    near TILE_QUERIES (each key then read once for them all), at least 2."""
    return max(2, 1 << (TILE_QUERIES // group).bit_length() - 1)


@functools.cache
def copy_blocks_kernel(kv_heads: int, head_dim: int, block_size: int, dtype: str, target_kind: str) -> tirx.PrimFunc:
    """pool[dst[i]] = pool[src[i]] for every i, in place (the pool is the first argument), for copy-on-write;
    the copies run in parallel, so no dst may be another copy's src."""
    block_elems = block_size * kv_heads * head_dim

    @T.prim_func(s_tir=True, private=True)
    def copy_blocks(pool_h: T.handle, src_h: T.handle, dst_h: T.handle):
        T.func_attr(ATTRS)
        num_blocks, count = T.int64(), T.int32()
        pool = T.match_buffer(pool_h, (num_blocks, block_size, kv_heads, head_dim), dtype)
        src = T.match_buffer(src_h, (count,), "int32")
        dst = T.match_buffer(dst_h, (count,), "int32")
        if _is_cuda(target_kind):
            for i in T.thread_binding(count, thread="blockIdx.x"):
                for tx in T.thread_binding(CUDA_THREADS, thread="threadIdx.x"):
                    for c in T.serial(T.ceildiv(block_elems, CUDA_THREADS)):
                        e: T.let[T.int32] = c * CUDA_THREADS + tx
                        if e < block_elems:
                            o: T.let[T.int32] = e // (kv_heads * head_dim)
                            h: T.let[T.int32] = e // head_dim % kv_heads
                            pool[dst[i], o, h, e % head_dim] = pool[src[i], o, h, e % head_dim]
        else:
            for i in T.parallel(count):
                for o, h in T.grid(block_size, kv_heads):
                    for d in T.vectorized(head_dim):
                        pool[dst[i], o, h, d] = pool[src[i], o, h, d]

    return copy_blocks


def emit_paged_attention(
    bb: relax.BlockBuilder,
    q: relax.Expr,
    k: relax.Expr,
    v: relax.Expr,
    k_pool: relax.Expr,
    v_pool: relax.Expr,
    block_tables: relax.Expr,
    past_lens: relax.Expr,
    query_start: relax.Expr,
    *,
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    scale: float,
    window: int,
    target: Target,
    softcap: float = 0.0,
    sinks: relax.Expr | None = None,
    value_head_dim: int | None = None,
    alibi_slopes: relax.Expr | None = None,
    latent: bool = False,
    k_scale: relax.Expr | None = None,
    v_scale: relax.Expr | None = None,
) -> relax.Var:
    """Append k/v into the pools in place, then attend over the updated pools: out [N, heads, value_head_dim]
    ([N, heads, head_dim] with `latent`: keys [k_pool | v_pool], values k_pool, see attention_kernel). The
    attention reads the append's outputs, which orders the two and keeps the append alive. `sinks` [heads]
    (any float type) are the heads' sink logits and `alibi_slopes` [heads] their ALiBi slopes; the kernel reads
    a float32 [heads] argument for each either way (zeros, unread, when absent). int8 pools come with k_scale and
    v_scale (any shape of kv_heads x head_dim elements); the kernels read a float32 [kv_heads, head_dim] argument for
    each either way (ones, unread, for float pools)."""
    dtype, kind, pool_dtype = q.ty.dtype, target.kind.name, k_pool.ty.dtype
    dv = value_head_dim or head_dim
    scales = [
        relax.const(np.ones((kv_heads, width), "float32"))
        if x is None
        else bb.emit(relax.op.reshape(relax.op.astype(x, "float32"), [kv_heads, width]))
        for x, width in ((k_scale, head_dim), (v_scale, dv))
    ]
    kernel = append_kernel(kv_heads, head_dim, block_size, dtype, kind, dv, pool_dtype)
    append = bb.add_func(kernel, "paged_append")
    pools = bb.emit(
        relax.call_tir_inplace(
            append,
            [k_pool, v_pool, k, v, block_tables, past_lens, query_start, *scales],
            [0, 1],
            [k_pool.ty, v_pool.ty],
        )
    )
    attention = attention_kernel(
        heads,
        kv_heads,
        head_dim,
        block_size,
        dtype,
        scale,
        window,
        kind,
        softcap,
        sinks is not None,
        dv,
        alibi_slopes is not None,
        latent,
        pool_dtype,
        float_lanes(target) if kind == "llvm" else LANES,
    )
    per_head = [
        relax.const(np.zeros(heads, "float32")) if x is None else bb.emit(relax.op.astype(x, "float32"))
        for x in (sinks, alibi_slopes)
    ]
    updated = [bb.emit(relax.TupleGetItem(pools, i)) for i in range(2)]
    return bb.emit(
        relax.call_tir(
            bb.add_func(attention, "paged_attention"),
            [q, *updated, block_tables, past_lens, query_start, *per_head, *scales],
            relax.TensorType([q.ty.shape[0], heads, head_dim if latent else dv], dtype),
        )
    )


def _in_dtype(out: te.Tensor, dtype: str) -> te.Tensor:
    """A float32 accumulation returned in the graph's dtype."""
    return out if dtype == "float32" else te.compute(out.shape, lambda *i: out[i].astype(dtype), name="cast")


def _absorb_te(q_nope: te.Tensor, kv_weight: te.Tensor, width: int) -> te.Tensor:
    """q_nope [N, heads, nope] into the latent space, [N, heads, rank]: head h through its key rows of kv_weight
    (rows h * width .. h * width + nope of [heads * width, rank]), read in place."""
    k = te.reduce_axis((0, q_nope.shape[2]), name="k")
    absorbed = te.compute(
        (*q_nope.shape[:2], kv_weight.shape[1]),
        lambda t, h, r: te.sum(
            q_nope[t, h, k].astype("float32") * kv_weight[h * width + k, r].astype("float32"), axis=k
        ),
        name="absorb",
    )
    return _in_dtype(absorbed, q_nope.dtype)


def _value_rows_te(latent_out: te.Tensor, kv_weight: te.Tensor, width: int, nope: int) -> te.Tensor:
    """Each head's attention output in the latent space [N, heads, rank] out of it, [N, heads, width - nope]:
    head h through its value rows of kv_weight (rows h * width + nope .. (h + 1) * width), read in place."""
    r = te.reduce_axis((0, kv_weight.shape[1]), name="r")
    out = te.compute(
        (*latent_out.shape[:2], width - nope),
        lambda t, h, v: te.sum(
            latent_out[t, h, r].astype("float32") * kv_weight[h * width + nope + v, r].astype("float32"), axis=r
        ),
        name="value_rows",
    )
    return _in_dtype(out, latent_out.dtype)


def emit_paged_latent_attention(
    bb: relax.BlockBuilder,
    q: relax.Expr,
    latent: relax.Expr,
    k_pe: relax.Expr,
    kv_weight: relax.Expr,
    c_pool: relax.Expr,
    pe_pool: relax.Expr,
    block_tables: relax.Expr,
    past_lens: relax.Expr,
    query_start: relax.Expr,
    *,
    scale: float,
    window: int,
    target: Target,
) -> relax.Var:
    """ir/latent_attention.py's weight-absorbed MLA over rows, out [N, heads, dv]: q [N, heads, nope + rope]
    absorbed into the latent space, the step's latent [N, 1, rank] and k_pe [N, 1, rope] appended in place into
    c_pool and pe_pool, one kv head attended over keys [c, k_pe] and values c (`latent`: the pools are read where
    they lie, never concatenated), each head's output taken out of the latent space by its value rows of
    kv_weight [heads * (nope + dv), rank]."""
    heads, rope = int(q.ty.shape[1]), int(k_pe.ty.shape[2])
    nope, width = int(q.ty.shape[2]) - rope, int(kv_weight.ty.shape[0]) // heads
    parts = bb.emit(relax.op.split(q, [nope], axis=2))
    q_nope, q_pe = (bb.emit(relax.TupleGetItem(parts, i)) for i in range(2))
    absorbed = bb.emit_te(_absorb_te, q_nope, kv_weight, width, primfunc_name_hint="latent_absorb")
    out = emit_paged_attention(
        bb,
        bb.emit(relax.op.concat([absorbed, q_pe], axis=2)),
        latent,
        k_pe,
        c_pool,
        pe_pool,
        block_tables,
        past_lens,
        query_start,
        heads=heads,
        kv_heads=1,
        head_dim=int(c_pool.ty.shape[3]),
        block_size=int(c_pool.ty.shape[1]),
        scale=scale,
        window=window,
        target=target,
        value_head_dim=rope,
        latent=True,
    )
    return bb.emit_te(_value_rows_te, out, kv_weight, width, nope, primfunc_name_hint="latent_value_rows")


def emit_copy_blocks(
    bb: relax.BlockBuilder, pool: relax.Expr, src: relax.Expr, dst: relax.Expr, target: Target
) -> relax.Var:
    """pool[dst[i]] = pool[src[i]] in place; the result (the pool) must be used, e.g. returned, or dead-code
    elimination drops the copy."""
    ty = pool.ty
    block_size, kv_heads, head_dim = (int(ty.shape[i]) for i in (1, 2, 3))
    kernel = copy_blocks_kernel(kv_heads, head_dim, block_size, ty.dtype, target.kind.name)
    return bb.emit(relax.call_tir_inplace(bb.add_func(kernel, "copy_blocks"), [pool, src, dst], [0], ty))
