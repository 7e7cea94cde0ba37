"""The program as a function of its weights: every tensor the graph reads through get_attr becomes an argument
after the program's inputs, so the MLIR module carries no weights (they are saved apart, as safetensors)."""

from __future__ import annotations

import re
from dataclasses import replace

import torch
import torch.fx

from ...ir.program import Program, TensorSpec, fetch_attr


def lift_weights(program: Program) -> tuple[Program, dict[str, torch.Tensor]]:
    """A copy of `program` whose graph takes its weights as inputs (named by their attribute path; a tensor read
    under several names is one input), and those weights by name in argument order. Views become reshapes: a
    decomposition may give a tensor other strides than the op's fake kernel declared, and a view of those fails."""
    module = program.graph_module
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(module.graph, {}))
    anchor = [node for node in graph.nodes if node.op == "placeholder"][-1]
    lifted: dict[int, torch.fx.Node] = {}
    weights: dict[str, torch.Tensor] = {}
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is torch.ops.aten.view.default:
            node.target = torch.ops.aten.reshape.default
        if node.op != "get_attr" or not isinstance(value := fetch_attr(module, node.target), torch.Tensor):
            continue
        if id(value) not in lifted:
            with graph.inserting_after(anchor):
                anchor = lifted[id(value)] = graph.placeholder(re.sub(r"\W", "_", node.target))  # an identifier
            weights[node.target] = value
        node.replace_all_uses_with(lifted[id(value)])
        graph.erase_node(node)
    specs = [TensorSpec(name, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for name, t in weights.items()]
    lifted_module = torch.fx.GraphModule(module, graph)
    return replace(program, graph_module=lifted_module, inputs=[*program.inputs, *specs], fresh_meta=False), weights
