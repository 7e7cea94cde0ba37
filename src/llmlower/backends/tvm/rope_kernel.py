"""The CPU kernel that splits a fused qkv projection into heads and rotates q and k (rotate-half RoPE) in one pass.

Relax ran this as a split into q, k and v copies, a gather of the cos and sin rows at the step's positions, and one
rotation kernel each for q and k: five kernel calls per layer, each with its output allocation and thread-pool
launch. Here each token's row is read once, its cos and sin read from the tables at its position (clipped to the
last row, as `take(mode="clip")` does), and q, k (rotated) and v written as the paged kernels take them.
"""

from __future__ import annotations

import functools

from tvm import relax, tirx
from tvm.script import tirx as T

from .paged_kernels import ATTRS
from .row_loop import over_rows


def takes(qkv: relax.Expr, cos_table: relax.Expr, sin_table: relax.Expr, head_dim: int) -> bool:
    """Whether the kernel takes these: float32 qkv [1, tokens, width] and float32 tables [positions, head_dim / 2]
    (rotating whole heads)."""
    return (
        qkv.ty.ndim == 3
        and isinstance(qkv.ty.shape[0], tirx.IntImm)
        and int(qkv.ty.shape[0]) == 1
        and all(
            t.ty.ndim == 2
            and all(isinstance(d, tirx.IntImm) for d in t.ty.shape)
            and 2 * int(t.ty.shape[1]) == head_dim
            for t in (cos_table, sin_table)
        )
        and all(t.ty.dtype == "float32" for t in (qkv, cos_table, sin_table))
    )


@functools.cache
def rotated_qkv_kernel(heads: int, kv_heads: int, head_dim: int, value_head_dim: int, positions: int) -> tirx.PrimFunc:
    """q [N, heads, head_dim], k [N, kv_heads, head_dim] (both rotated at position_ids [1, N]) and v [N, kv_heads,
    value_head_dim] out of qkv [1, N, heads * head_dim + kv_heads * (head_dim + value_head_dim)]."""
    half = head_dim // 2
    width = (heads + kv_heads) * head_dim + kv_heads * value_head_dim

    @T.macro
    def rotate(qkv, cos, sin, out, t, head, first, at):  # out[t, head] = qkv's head first + head, rotated
        for j in T.serial(half):
            out[t, head, j] = qkv[0, t, (first + head) * head_dim + j] * cos[at, j] - (
                qkv[0, t, (first + head) * head_dim + half + j] * sin[at, j]
            )
            out[t, head, half + j] = qkv[0, t, (first + head) * head_dim + half + j] * cos[at, j] + (
                qkv[0, t, (first + head) * head_dim + j] * sin[at, j]
            )

    @T.macro
    def rotated_token(t, qkv, position_ids, cos, sin, q, k, v):  # token t's q, k (rotated) and v
        at: T.let[T.int64] = T.max(T.min(position_ids[0, t], T.int64(positions - 1)), T.int64(0))
        for h in T.serial(heads):
            rotate(qkv, cos, sin, q, t, h, 0, at)
        for h in T.serial(kv_heads):
            rotate(qkv, cos, sin, k, t, h, heads, at)
            for j in T.serial(value_head_dim):
                v[t, h, j] = qkv[0, t, (heads + kv_heads) * head_dim + h * value_head_dim + j]

    @T.prim_func(s_tir=True, private=True)
    def rotated_qkv(
        qkv_h: T.handle, p_h: T.handle, c_h: T.handle, s_h: T.handle, q_h: T.handle, k_h: T.handle, v_h: T.handle
    ):
        T.func_attr(ATTRS)
        n = T.int64()
        qkv = T.match_buffer(qkv_h, (1, n, width), "float32")
        position_ids = T.match_buffer(p_h, (1, n), "int64")
        cos = T.match_buffer(c_h, (positions, half), "float32")
        sin = T.match_buffer(s_h, (positions, half), "float32")
        q = T.match_buffer(q_h, (n, heads, head_dim), "float32")
        k = T.match_buffer(k_h, (n, kv_heads, head_dim), "float32")
        v = T.match_buffer(v_h, (n, kv_heads, value_head_dim), "float32")
        with T.sblock("root"):
            T.reads()
            T.writes()
            over_rows(n, rotated_token, (qkv, position_ids, cos, sin, q, k, v))

    return rotated_qkv


def emit_rotated_qkv(
    bb: relax.BlockBuilder,
    qkv: relax.Expr,
    position_ids: relax.Expr,
    tables: tuple[relax.Expr, relax.Expr],
    heads: int,
    kv_heads: int,
    head_dim: int,
    value_head_dim: int,
) -> tuple[relax.Var, relax.Var, relax.Var]:
    """(q, k, v) for the paged kernels, as one kernel call, for inputs `takes` accepts."""
    tokens = qkv.ty.shape[1]
    positions = int(tables[0].ty.shape[0])
    kernel = rotated_qkv_kernel(heads, kv_heads, head_dim, value_head_dim, positions)
    shapes = ((heads, head_dim), (kv_heads, head_dim), (kv_heads, value_head_dim))
    outs = [relax.TensorType([tokens, *shape], "float32") for shape in shapes]
    parts = bb.emit(relax.call_tir(bb.add_func(kernel, "rotated_qkv"), [qkv, position_ids, *tables], outs))
    q, k, v = (bb.emit(relax.TupleGetItem(parts, i)) for i in range(3))
    return q, k, v
