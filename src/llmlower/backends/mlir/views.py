"""Views that merge dynamic dimensions, as aten.flatten: torch-mlir's linalg lowering of such an aten.view guesses
which input dimensions merge (torch-mlir issue #3852: [?, ?, D] -> [?, D] becomes [?] + [1 x D], the token
dimension cast to 1, and a step of several sequences of several tokens then reads out of bounds), where its
lowering of aten.flatten collapses exactly the dimensions named. Applied to the decomposed graph torch-mlir
imports; the torch backend pipeline keeps aten.flatten for the dialect lowerings (backend-legal-ops)."""

from __future__ import annotations

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


def flatten_views(graph: torch.fx.Graph) -> int:
    """Rewrite each view that merges a range of dimensions, one of them dynamic, as aten.flatten.using_ints of
    that range (the same tensor); returns how many were rewritten."""
    rewritten = 0
    for node in graph.nodes:
        if node.op != "call_function" or node.target not in VIEWS or not isinstance(node.args[0], torch.fx.Node):
            continue
        before, after = node.args[0].meta.get("val"), node.meta.get("val")
        if not isinstance(before, torch.Tensor) or not isinstance(after, torch.Tensor):
            continue
        span = merged_range(tuple(before.shape), tuple(after.shape))
        if span is None or all(isinstance(d, int) for d in before.shape[span[0] : span[1] + 1]):
            continue
        node.target = torch.ops.aten.flatten.using_ints
        node.args, node.kwargs = (node.args[0], *span), {}
        rewritten += 1
    return rewritten
