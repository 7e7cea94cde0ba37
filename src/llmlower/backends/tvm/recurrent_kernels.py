"""CPU kernels of the recurrent ops in the PAGED layout (ir/paged_recurrent.py): a hybrid model's short
convolutions, Gated DeltaNet's delta rule, and Mamba's and Mamba-2's scans.

A step packs S sequences' new tokens into N rows (`query_start [S + 1]` says which are whose, `past_lens [S]` how
many each already has) and each state is a pool of rows the caller owns, sequence s's row `state_slots[s]`. One
task per (sequence, head or channel), across the thread pool: it reads its piece of the state from the pool
(zeros for a sequence that starts), runs its sequence's tokens in order and leaves the state in the pool, in place
(`relax.call_tir_inplace`, as the KV pools' append): a decode step moves each state between memory and the cores
once (the delta rule's two passes a token over a head's state, 64 KB at 128 x 128, find it in cache the second
time). The outputs are fresh tensors. Arithmetic in float32 whatever the model's dtype, as the references do.
"""

from __future__ import annotations

import functools
import math

from tvm import relax, tirx
from tvm.script import tirx as T

from .paged_kernels import ATTRS


def _softplus(x: tirx.PrimExpr) -> tirx.PrimExpr:
    """torch's softplus: x itself above 20, where log1p(exp(x)) rounds to it."""
    return T.if_then_else(x > T.float32(20.0), x, T.log1p(T.exp(x)))


@functools.cache
def conv_kernel(channels: int, width: int, dtype: str, state_dtype: str) -> tirx.PrimFunc:
    """out [1, channels, N]: each channel's causal convolution (+ bias: zeros where the model has none) over its
    sequence's tokens, the last width - 1 inputs before the step read from the state row and the last width - 1
    after it written there."""
    taps = width - 1

    @T.prim_func(s_tir=True, private=True)
    def paged_conv(
        pool_h: T.handle,
        x_h: T.handle,
        weight_h: T.handle,
        bias_h: T.handle,
        slots_h: T.handle,
        past_h: T.handle,
        starts_h: T.handle,
        out_h: T.handle,
    ):
        T.func_attr(ATTRS)
        n, num_seqs, rows = T.int32(), T.int32(), T.int64()
        pool = T.match_buffer(pool_h, (rows, channels, taps), state_dtype)
        x = T.match_buffer(x_h, (1, channels, n), dtype)
        weight = T.match_buffer(weight_h, (channels, width), dtype)
        bias_ = T.match_buffer(bias_h, (channels,), dtype)
        slots = T.match_buffer(slots_h, (num_seqs,), "int32")
        past_lens = T.match_buffer(past_h, (num_seqs,), "int32")
        query_start = T.match_buffer(starts_h, (num_seqs + 1,), "int32")
        out = T.match_buffer(out_h, (1, channels, n), dtype)
        with T.sblock("root"):
            T.reads()
            T.writes()
            for task in T.parallel(num_seqs * channels):
                with T.sblock("conv"):
                    T.reads()
                    T.writes()
                    window = T.sblock_alloc_buffer((taps,), "float32")
                    total = T.sblock_alloc_buffer((1,), "float32")
                    s: T.let[T.int32] = task // channels
                    c: T.let[T.int32] = task % channels
                    row: T.let[T.int32] = slots[s]
                    for j in T.serial(taps):
                        window[j] = T.if_then_else(past_lens[s] == 0, T.float32(0), T.Cast("float32", pool[row, c, j]))
                    for t in T.serial(query_start[s], query_start[s + 1]):
                        total[0] = T.Cast("float32", x[0, c, t]) * T.Cast("float32", weight[c, taps])
                        total[0] += T.Cast("float32", bias_[c])
                        for j in T.serial(taps):
                            total[0] += window[j] * T.Cast("float32", weight[c, j])
                        out[0, c, t] = T.Cast(dtype, total[0])
                        for j in T.serial(taps - 1):
                            window[j] = window[j + 1]
                        window[taps - 1] = T.Cast("float32", x[0, c, t])
                    for j in T.serial(taps):
                        pool[row, c, j] = T.Cast(state_dtype, window[j])

    return paged_conv


@functools.cache
def delta_kernel(key_heads: int, heads: int, dk: int, dv: int, dtype: str, l2norm: bool) -> tirx.PrimFunc:
    """out [1, N, heads, dv]: each value head's delta rule over its sequence's tokens on its float32 state
    [dk, dv] in the pool (decay, the key's prediction, the update, the query's read), q and k L2-normalised when
    asked and q scaled by 1 / sqrt(dk)."""
    group = heads // key_heads
    scale = 1.0 / math.sqrt(dk)

    @T.prim_func(s_tir=True, private=True)
    def paged_delta(
        pool_h: T.handle,
        q_h: T.handle,
        k_h: T.handle,
        v_h: T.handle,
        g_h: T.handle,
        beta_h: T.handle,
        slots_h: T.handle,
        past_h: T.handle,
        starts_h: T.handle,
        out_h: T.handle,
    ):
        T.func_attr(ATTRS)
        n, num_seqs, rows = T.int32(), T.int32(), T.int64()
        pool = T.match_buffer(pool_h, (rows, heads, dk, dv), "float32")
        q = T.match_buffer(q_h, (1, n, key_heads, dk), dtype)
        k = T.match_buffer(k_h, (1, n, key_heads, dk), dtype)
        v = T.match_buffer(v_h, (1, n, heads, dv), dtype)
        g = T.match_buffer(g_h, (1, n, heads), dtype)
        beta = T.match_buffer(beta_h, (1, n, heads), dtype)
        slots = T.match_buffer(slots_h, (num_seqs,), "int32")
        past_lens = T.match_buffer(past_h, (num_seqs,), "int32")
        query_start = T.match_buffer(starts_h, (num_seqs + 1,), "int32")
        out = T.match_buffer(out_h, (1, n, heads, dv), dtype)
        with T.sblock("root"):
            T.reads()
            T.writes()
            for task in T.parallel(num_seqs * heads):
                with T.sblock("delta"):
                    T.reads()
                    T.writes()
                    qn = T.sblock_alloc_buffer((dk,), "float32")
                    kn = T.sblock_alloc_buffer((dk,), "float32")
                    delta = T.sblock_alloc_buffer((dv,), "float32")
                    read = T.sblock_alloc_buffer((dv,), "float32")
                    norms = T.sblock_alloc_buffer((2,), "float32")
                    s: T.let[T.int32] = task // heads
                    h: T.let[T.int32] = task % heads
                    kh: T.let[T.int32] = h // group
                    row: T.let[T.int32] = slots[s]
                    if past_lens[s] == 0:
                        for i, j in T.grid(dk, dv):
                            pool[row, h, i, j] = T.float32(0)
                    for t in T.serial(query_start[s], query_start[s + 1]):
                        norms[0] = T.float32(1)
                        norms[1] = T.float32(1)
                        if l2norm:
                            norms[0] = T.float32(1e-6)
                            norms[1] = T.float32(1e-6)
                            for i in T.serial(dk):
                                norms[0] += T.Cast("float32", q[0, t, kh, i]) * T.Cast("float32", q[0, t, kh, i])
                                norms[1] += T.Cast("float32", k[0, t, kh, i]) * T.Cast("float32", k[0, t, kh, i])
                        for i in T.serial(dk):
                            qn[i] = T.Cast("float32", q[0, t, kh, i]) * T.rsqrt(norms[0]) * T.float32(scale)
                            kn[i] = T.Cast("float32", k[0, t, kh, i]) * T.rsqrt(norms[1])
                        decay: T.let[T.float32] = T.exp(T.Cast("float32", g[0, t, h]))
                        for j in T.serial(dv):
                            delta[j] = T.float32(0)
                            read[j] = T.float32(0)
                        for i, j in T.grid(dk, dv):
                            pool[row, h, i, j] = pool[row, h, i, j] * decay
                            delta[j] += pool[row, h, i, j] * kn[i]
                        for j in T.serial(dv):
                            delta[j] = (T.Cast("float32", v[0, t, h, j]) - delta[j]) * T.Cast("float32", beta[0, t, h])
                        for i, j in T.grid(dk, dv):
                            pool[row, h, i, j] = pool[row, h, i, j] + kn[i] * delta[j]
                            read[j] += pool[row, h, i, j] * qn[i]
                        for j in T.serial(dv):
                            out[0, t, h, j] = T.Cast(dtype, read[j])

    return paged_delta


@functools.cache
def selective_kernel(channels: int, state_size: int, dtype: str, gate: bool, softplus: bool) -> tirx.PrimFunc:
    """y [1, channels, N]: each channel's selective scan (Mamba) over its sequence's tokens on its float32 state
    [state_size] in the pool: dt discretised (+ bias, softplus), S <- exp(dt A) S + dt x B, y = C S, then y + D x
    and y silu(z) where the model has a gate (bias and D zeros where it has none)."""

    @T.prim_func(s_tir=True, private=True)
    def paged_selective(
        pool_h: T.handle,
        x_h: T.handle,
        dt_h: T.handle,
        a_h: T.handle,
        b_h: T.handle,
        c_h: T.handle,
        d_h: T.handle,
        z_h: T.handle,
        bias_h: T.handle,
        slots_h: T.handle,
        past_h: T.handle,
        starts_h: T.handle,
        out_h: T.handle,
    ):
        T.func_attr(ATTRS)
        n, num_seqs, rows = T.int32(), T.int32(), T.int64()
        pool = T.match_buffer(pool_h, (rows, channels, state_size), "float32")
        x = T.match_buffer(x_h, (1, channels, n), dtype)
        dt = T.match_buffer(dt_h, (1, channels, n), dtype)
        A = T.match_buffer(a_h, (channels, state_size), "float32")
        B = T.match_buffer(b_h, (1, state_size, n), dtype)
        C = T.match_buffer(c_h, (1, state_size, n), dtype)
        D = T.match_buffer(d_h, (channels,), "float32")
        z = T.match_buffer(z_h, (1, channels, n), dtype)
        bias_ = T.match_buffer(bias_h, (channels,), "float32")
        slots = T.match_buffer(slots_h, (num_seqs,), "int32")
        past_lens = T.match_buffer(past_h, (num_seqs,), "int32")
        query_start = T.match_buffer(starts_h, (num_seqs + 1,), "int32")
        out = T.match_buffer(out_h, (1, channels, n), dtype)
        with T.sblock("root"):
            T.reads()
            T.writes()
            for task in T.parallel(num_seqs * channels):
                with T.sblock("selective"):
                    T.reads()
                    T.writes()
                    step = T.sblock_alloc_buffer((1,), "float32")
                    y = T.sblock_alloc_buffer((1,), "float32")
                    s: T.let[T.int32] = task // channels
                    c: T.let[T.int32] = task % channels
                    row: T.let[T.int32] = slots[s]
                    if past_lens[s] == 0:
                        for i in T.serial(state_size):
                            pool[row, c, i] = T.float32(0)
                    for t in T.serial(query_start[s], query_start[s + 1]):
                        step[0] = T.Cast("float32", dt[0, c, t]) + bias_[c]
                        if softplus:
                            step[0] = _softplus(step[0])
                        xt: T.let[T.float32] = T.Cast("float32", x[0, c, t])
                        y[0] = T.float32(0)
                        for i in T.serial(state_size):
                            pool[row, c, i] = (
                                T.exp(A[c, i] * step[0]) * pool[row, c, i]
                                + step[0] * T.Cast("float32", B[0, i, t]) * xt
                            )
                            y[0] += pool[row, c, i] * T.Cast("float32", C[0, i, t])
                        y[0] = T.Cast("float32", T.Cast(dtype, y[0])) + xt * D[c]  # the reference's cast first
                        if gate:
                            zt: T.let[T.float32] = T.Cast("float32", z[0, c, t])
                            y[0] = y[0] * zt * T.sigmoid(zt)
                        out[0, c, t] = T.Cast(dtype, y[0])

    return paged_selective


@functools.cache
def ssd_kernel(
    heads: int,
    head_dim: int,
    groups: int,
    state_size: int,
    dtype: str,
    softplus: bool,
    dt_min: float,
    dt_max: float | None,
) -> tirx.PrimFunc:
    """y [1, N, heads, head_dim] (float32): each head's Mamba-2 scan over its sequence's tokens on its float32
    state [head_dim, state_size] in the pool: dt discretised (+ bias, softplus, clamped to [dt_min, dt_max]: no
    upper bound where None), S <- S
    exp(dt A) + dt x B^T, y = S C, then y + D x (bias and D zeros where the model has none)."""
    per_group = heads // groups

    @T.prim_func(s_tir=True, private=True)
    def paged_ssd(
        pool_h: T.handle,
        x_h: T.handle,
        dt_h: T.handle,
        a_h: T.handle,
        b_h: T.handle,
        c_h: T.handle,
        d_h: T.handle,
        bias_h: T.handle,
        slots_h: T.handle,
        past_h: T.handle,
        starts_h: T.handle,
        out_h: T.handle,
    ):
        T.func_attr(ATTRS)
        n, num_seqs, rows = T.int32(), T.int32(), T.int64()
        pool = T.match_buffer(pool_h, (rows, heads, head_dim, state_size), "float32")
        x = T.match_buffer(x_h, (1, n, heads, head_dim), dtype)
        dt = T.match_buffer(dt_h, (1, n, heads), dtype)
        A = T.match_buffer(a_h, (heads,), "float32")
        B = T.match_buffer(b_h, (1, n, groups, state_size), dtype)
        C = T.match_buffer(c_h, (1, n, groups, state_size), dtype)
        D = T.match_buffer(d_h, (heads,), "float32")
        bias_ = T.match_buffer(bias_h, (heads,), "float32")
        slots = T.match_buffer(slots_h, (num_seqs,), "int32")
        past_lens = T.match_buffer(past_h, (num_seqs,), "int32")
        query_start = T.match_buffer(starts_h, (num_seqs + 1,), "int32")
        out = T.match_buffer(out_h, (1, n, heads, head_dim), "float32")
        with T.sblock("root"):
            T.reads()
            T.writes()
            for task in T.parallel(num_seqs * heads):
                with T.sblock("ssd"):
                    T.reads()
                    T.writes()
                    step = T.sblock_alloc_buffer((1,), "float32")
                    y = T.sblock_alloc_buffer((head_dim,), "float32")
                    s: T.let[T.int32] = task // heads
                    h: T.let[T.int32] = task % heads
                    grp: T.let[T.int32] = h // per_group
                    row: T.let[T.int32] = slots[s]
                    if past_lens[s] == 0:
                        for p, i in T.grid(head_dim, state_size):
                            pool[row, h, p, i] = T.float32(0)
                    for t in T.serial(query_start[s], query_start[s + 1]):
                        step[0] = T.Cast("float32", dt[0, t, h]) + bias_[h]
                        if softplus:
                            step[0] = _softplus(step[0])
                        step[0] = T.max(step[0], T.float32(dt_min))
                        if dt_max is not None:
                            step[0] = T.min(step[0], T.float32(dt_max))
                        decay: T.let[T.float32] = T.exp(step[0] * A[h])
                        for p in T.serial(head_dim):
                            y[p] = T.float32(0)
                            xt: T.let[T.float32] = step[0] * T.Cast("float32", x[0, t, h, p])
                            for i in T.serial(state_size):
                                pool[row, h, p, i] = pool[row, h, p, i] * decay + xt * T.Cast(
                                    "float32", B[0, t, grp, i]
                                )
                                y[p] += pool[row, h, p, i] * T.Cast("float32", C[0, t, grp, i])
                        for p in T.serial(head_dim):
                            out[0, t, h, p] = y[p] + D[h] * T.Cast("float32", x[0, t, h, p])

    return paged_ssd


def emit_paged_recurrence(
    bb: relax.BlockBuilder,
    kernel: tirx.PrimFunc,
    name: str,
    pool: relax.Expr,
    inputs: list[relax.Expr],
    step_inputs: tuple[relax.Expr, relax.Expr, relax.Expr],
    out: relax.TensorType,
) -> relax.Tuple:
    """(out, the pool updated in place) of `kernel` called on the pool, `inputs` and (state_slots, past_lens,
    query_start) as int32."""
    call = relax.call_tir_inplace(bb.add_func(kernel, name), [pool, *inputs, *step_inputs], [0, -1], [pool.ty, out])
    result = bb.emit(call)
    return relax.Tuple([bb.emit(relax.TupleGetItem(result, 1)), bb.emit(relax.TupleGetItem(result, 0))])
