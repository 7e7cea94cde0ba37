"""Small FX helpers shared by passes."""

from __future__ import annotations

import torch
import torch.fx


def remove_unused_constants(gm: torch.fx.GraphModule) -> None:
    """Drop get_attr nodes nobody reads and the weights/buffers only they referenced."""
    for node in list(gm.graph.nodes):
        if node.op == "get_attr" and not node.users:
            gm.graph.erase_node(node)
    used = {node.target for node in gm.graph.nodes if node.op == "get_attr"}
    for name, _ in list(gm.named_parameters()) + list(gm.named_buffers()):
        if name not in used:
            owner, _, attr = name.rpartition(".")
            module = gm.get_submodule(owner) if owner else gm
            delattr(module, attr)
    gm.delete_all_unused_submodules()


def tensor_meta(node: torch.fx.Node) -> torch.Tensor | None:
    """The fake tensor torch.export recorded for a node, if any."""
    value = node.meta.get("val")
    return value if isinstance(value, torch.Tensor) else None


def finish(gm: torch.fx.GraphModule) -> None:
    """Dead-code elimination, unused weights dropped, code regenerated."""
    gm.graph.eliminate_dead_code()
    remove_unused_constants(gm)
    gm.graph.lint()
    gm.recompile()
