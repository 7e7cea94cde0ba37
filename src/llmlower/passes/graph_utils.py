"""Small FX helpers shared by passes."""

from __future__ import annotations

import re

import torch
import torch.fx

from ..ir.program import INPUT_LENS, PAST_LENS, Program, TensorSpec

aten = torch.ops.aten
# the aten ops that give a tensor another shape over the same elements, as torch.export records them
RESHAPES = frozenset({aten.view.default, aten.reshape.default, aten._unsafe_view.default})


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


def output_node_for(gm: torch.fx.GraphModule, output_names: list[str], name: str) -> torch.fx.Node:
    """The graph node returned as output `name`."""
    return gm.graph.output_node().args[0][output_names.index(name)]


def placeholder(gm: torch.fx.GraphModule, name: str) -> torch.fx.Node:
    return next(n for n in gm.graph.nodes if n.op == "placeholder" and n.target == name)


def lm_head(gm: torch.fx.GraphModule, logits: torch.fx.Node, heads: set) -> torch.fx.Node | None:
    """The matmul producing `logits`: the node itself, or found through single-input ops applied after it
    (a final softcap, a cast). `heads` are the op targets that count as a matmul."""
    node = logits
    while node.op == "call_function":
        if node.target in heads:
            return node
        inputs = node.all_input_nodes
        if len(inputs) != 1:
            return None
        node = inputs[0]
    return None


def replace_uses(old: list[torch.fx.Node], new: list[torch.fx.Node]) -> None:
    """Point every user of each old node at its replacement, which takes over its shape metadata."""
    for before, after in zip(old, new, strict=True):
        if "val" in before.meta:
            after.meta["val"] = before.meta["val"]
        before.replace_all_uses_with(after)


_LAYER_PATH = re.compile(r"\.(\d+)$")


def decoder_layer(node: torch.fx.Node) -> int | None:
    """The index of the decoder layer a captured node belongs to: the first module on its stack that is an
    item of a module list (model.layers.3 -> 3), as torch.export records it; None where that is not recorded."""
    for path, _ in node.meta.get("nn_module_stack", {}).values():
        match = _LAYER_PATH.search(path)
        if match:
            return int(match.group(1))
    return None


def step_lengths(program: Program) -> tuple[torch.fx.Node, torch.fx.Node, list[TensorSpec]]:
    """The placeholders past_lens and input_lens [batch] of a step over a cache, added after the program's last
    input by the first pass that gives it a cache (kv_cache, state_cache); returns them and the inputs added."""
    gm = program.graph_module
    if PAST_LENS in program.input_names:
        return placeholder(gm, PAST_LENS), placeholder(gm, INPUT_LENS), []
    past_lens, input_lens = add_input(gm.graph, PAST_LENS), add_input(gm.graph, INPUT_LENS)
    added = [TensorSpec(PAST_LENS, "int64", ("batch",)), TensorSpec(INPUT_LENS, "int64", ("batch",))]
    return past_lens, input_lens, added


def add_input(graph: torch.fx.Graph, name: str) -> torch.fx.Node:
    """A new placeholder after the graph's last one (so the program's input list grows at its end)."""
    last = [n for n in graph.nodes if n.op == "placeholder"][-1]
    with graph.inserting_after(last):
        return graph.placeholder(name)
