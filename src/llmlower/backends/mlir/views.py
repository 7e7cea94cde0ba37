"""Views that merge dynamic dimensions, as aten.flatten: torch-mlir's linalg lowering of such an aten.view guesses
which input dimensions merge (torch-mlir issue #3852: [?, ?, D] -> [?, D] becomes [?] + [1 x D], the token dimension
cast to 1, and a step of several sequences of several tokens then reads out of bounds), where its lowering of
aten.flatten collapses exactly the dimensions named. A view that also splits its last, static dimension ([?, ?, 96]
-> [? * 4, 24], OLMo's hybrid) becomes an unflatten of that dimension, then the flatten. Applied to the decomposed
graph torch-mlir imports; the torch backend pipeline keeps aten.flatten for the dialect lowerings
(backend-legal-ops)."""

from __future__ import annotations

import math

import torch
import torch.fx

FLATTEN = "aten.flatten.using_ints"  # the op name torch-mlir's backend-legal-ops option takes
VIEWS = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default, torch.ops.aten.reshape.default)


def merged_range(before: tuple, after: tuple) -> tuple[int, int] | None:
    """(start, end) when shape `after` is shape `before` with dimensions start..end merged into one, else None."""
    extra = len(before) - len(after)
    if extra < 1:
        return None
    for start in range(len(after)):
        if before[:start] == after[:start] and before[start + extra + 1 :] == after[start + 1 :]:
            return start, start + extra
    return None


def split_then_merged(before: tuple, after: tuple) -> list[int] | None:
    """The sizes, when shape `after` is shape `before` with its last dimension, static, split into them and then
    every dimension but the last len(after) - 1 merged into one; else None."""
    last, tail = before[-1], after[1:]
    if len(before) < 2 or not isinstance(last, int) or not all(isinstance(d, int) for d in tail):
        return None
    kept = math.prod(tail)
    if kept == 0 or last % kept or last == kept:
        return None
    return [last // kept, *tail]


def flatten_views(graph: torch.fx.Graph) -> int:
    """Rewrite each view that merges a range of dimensions, one of them dynamic, as aten.flatten.using_ints of
    that range (the same tensor), after an unflatten where it also splits the last dimension; returns how many
    were rewritten."""
    rewritten = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in VIEWS or not isinstance(node.args[0], torch.fx.Node):
            continue
        source = node.args[0]
        before, after = source.meta.get("val"), node.meta.get("val")
        if not isinstance(before, torch.Tensor) or not isinstance(after, torch.Tensor):
            continue
        span = merged_range(tuple(before.shape), tuple(after.shape))
        split = None if span is not None else split_then_merged(tuple(before.shape), tuple(after.shape))
        if split is not None:
            span = (0, before.dim() + len(split) - 1 - after.dim())
        if span is None or all(isinstance(d, int) for d in before.shape[span[0] : span[1] + 1]):
            continue
        if split is not None:
            with graph.inserting_before(node):
                source = graph.call_function(torch.ops.aten.unflatten.int, (source, -1, split))
            source.meta["val"] = before.unflatten(-1, split)
        node.target = torch.ops.aten.flatten.using_ints
        node.args, node.kwargs = (source, *span), {}
        rewritten += 1
    return rewritten
