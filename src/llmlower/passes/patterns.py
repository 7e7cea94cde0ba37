"""Pattern matching for fusion passes: patterns are small torch functions over aten ops, traced with
torch.fx and matched with torch.fx's SubgraphMatcher. Literals (eps, slice bounds, dims) match anything;
the pass reads them back from the matched nodes and checks them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch.fx.passes.utils.matcher_utils import InternalMatch, SubgraphMatcher

from ..ir.program import fetch_attr
from .graph_utils import tensor_meta


@dataclass
class Match:
    """One occurrence of a pattern: its inputs and outputs in the program's graph, and its inner nodes
    (in the pattern's order)."""

    inputs: list[torch.fx.Node]
    outputs: list[torch.fx.Node]
    nodes: list[torch.fx.Node]

    def all(self, target: Any) -> list[torch.fx.Node]:
        """The matched graph nodes calling `target`, in pattern order."""
        return [n for n in self.nodes if n.target is target]

    def node(self, target: Any) -> torch.fx.Node:
        """The first matched graph node calling `target`."""
        return self.all(target)[0]


class _LiteralWildcardMatcher(SubgraphMatcher):
    """A literal in the pattern matches any literal in the graph. (SubgraphMatcher's own ignore_literals
    also lets a pattern *node* stand for a graph literal, which leaves its inputs unmapped and crashes, e.g.
    on GPT-2's 0.5 * x.)"""

    def _match_literals(self, pn: Any, gn: Any, match: InternalMatch) -> bool:
        if not isinstance(pn, torch.fx.Node) and not isinstance(gn, torch.fx.Node):
            return True
        return super()._match_literals(pn, gn, match)


def find(gm: torch.fx.GraphModule, pattern: Callable[..., Any]) -> list[Match]:
    """Non-overlapping occurrences of `pattern` in the graph, in graph order."""
    pattern_graph = torch.fx.symbolic_trace(pattern).graph
    matcher = _LiteralWildcardMatcher(pattern_graph, remove_overlapping_matches=True)
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    matches = [_wrap(m, pattern_graph) for m in matcher.match(gm.graph)]
    return sorted(matches, key=lambda m: order[m.outputs[0]])


def _wrap(match: InternalMatch, pattern_graph: torch.fx.Graph) -> Match:
    nodes = [match.nodes_map[p] for p in pattern_graph.nodes if p.op == "call_function"]
    return Match(list(match.placeholder_nodes), list(match.returning_nodes), nodes)


def is_constant(node: Any) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "get_attr"


def last_dim(gm: torch.fx.GraphModule, node: torch.fx.Node) -> int | None:
    """Size of a node's last dimension: from the weight itself for get_attr, else from shape metadata."""
    value = fetch_attr(gm, node.target) if node.op == "get_attr" else tensor_meta(node)
    return int(value.shape[-1]) if isinstance(value, torch.Tensor) else None
