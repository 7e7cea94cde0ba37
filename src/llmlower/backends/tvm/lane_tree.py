"""Reducing a few values (a vector's lanes, a block's scores) in a balanced tree: log2(n) dependent operations where a
chain takes n, each waiting on the one before."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tvm import tirx


def tree(op: Callable[[tirx.PrimExpr, tirx.PrimExpr], tirx.PrimExpr], values: Sequence[tirx.PrimExpr]) -> tirx.PrimExpr:
    """op (associative: add, max) over the values, pairwise."""
    values = list(values)
    while len(values) > 1:
        values = [op(*values[i : i + 2]) if i + 1 < len(values) else values[i] for i in range(0, len(values), 2)]
    return values[0]


def buffer_tree(op: Callable, buffer: tirx.Buffer, prefix: tuple, count: int) -> tirx.PrimExpr:
    """op over buffer[*prefix, 0:count] (a TIR kernel's call: no comprehensions in TVMScript)."""
    return tree(op, [buffer[(*prefix, i)] for i in range(count)])


def lane_sum(vector: tirx.PrimExpr, dtype: str) -> tirx.PrimExpr:
    """The lanes of an integer vector of `dtype` elements summed, as LLVM reduces them (halves added in turn)."""
    return tirx.call_llvm_pure_intrin(dtype, "llvm.vector.reduce.add", vector)
