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


def _pair_shuffles(lanes: int, unit: int) -> tuple[list[int], list[int]]:
    """The two shuffles of a ++ b (`lanes` each) whose sum adds each two adjacent runs of `unit` lanes within blocks of
    four runs (of a vector where that is fewer), a's pairs then b's in each block: x86's phaddd for unit 1 (within
    128-bit chunks), a swap of 128-bit chunks for unit 4; each one or two shuffles."""
    block = min(lanes, 4 * unit)
    evens, odds = [], []
    for start in range(0, lanes, block):
        for source in (0, lanes):
            for pair in range(block // unit // 2):
                first = source + start + 2 * pair * unit
                evens += range(first, first + unit)
                odds += range(first + unit, first + 2 * unit)
    return evens, odds


def group_sums(vectors: Sequence[tirx.PrimExpr], lanes: int, group_lanes: int) -> tirx.PrimExpr:
    """The vectors' lanes laid end to end (`lanes` each, group_lanes of them) summed in runs of group_lanes (a power
    of two up to 16): one vector whose lane j holds run j. Pairs of vectors are added in 128-bit chunks while a run's
    lanes share one, then chunks are paired, and one shuffle puts the runs in order."""
    labels = [[(v * lanes + i) // group_lanes for i in range(lanes)] for v in range(len(vectors))]
    vectors = list(vectors)
    while len(vectors) > 1:
        pairs = list(zip(labels[::2], labels[1::2], strict=True))
        for unit in (1, 4):
            evens, odds = _pair_shuffles(lanes, unit)
            if all((x + y)[e] == (x + y)[o] for x, y in pairs for e, o in zip(evens, odds, strict=True)):
                break
        else:
            raise ValueError(f"runs of {group_lanes} lanes in vectors of {lanes}: no pairing sums them")
        labels = [[(x + y)[e] for e in evens] for x, y in pairs]
        vectors = [
            tirx.Shuffle([x, y], evens) + tirx.Shuffle([x, y], odds)
            for x, y in zip(vectors[::2], vectors[1::2], strict=True)
        ]
    order = [labels[0].index(run) for run in sorted(labels[0])]
    return vectors[0] if order == list(range(lanes)) else tirx.Shuffle([vectors[0]], order)
