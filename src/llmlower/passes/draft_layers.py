"""draft_layers: keep the first K decoder layers, then the final norm and LM head (an early-exit self-draft).

Speculative decoding needs a cheap draft model with the target's tokenizer; this pass makes one from the target
itself, with no training: the residual stream leaving decoder layer K-1 goes straight into the final norm.

Which nodes belong to which layer comes from the `nn_module_stack` torch.export records on every node: the
decoder layers are the one module list with an entry per layer of the config (`model.layers.0` ..
`model.layers.{N-1}`, GPT-2's `transformer.h.*`), whatever the architecture calls it. A layer's output is the one
node of the layer that nodes outside it read (the residual stream). The last layer's output, where the final norm
reads it, is replaced by layer K-1's output; dead code removal then drops layers K.. and their weights, and a
program that already has a KV cache loses the cache inputs and outputs of those layers.

Nodes a pass added have no module of their own (or, after a re-export, only the root's); they count in the layer of
their inputs, so kv_cache's attention, rope or fused projections stay in their layer and the pass also works after
them. It refuses a program whose boundaries it cannot find: a layer handing more than one tensor on, or a layer
output made by a pass (fuse_norms merges a layer's residual add with the next layer's norm). Compile runs it first,
on the captured graph.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import torch
import torch.fx

from ..errors import PassError
from ..ir.program import Program
from ..step_io import cache_layer
from .graph_utils import finish
from .registry import Pass, Tensors, Verification, register_pass

_INDEXED = re.compile(r"(.+)\.(\d+)")


@dataclasses.dataclass(frozen=True)
class _Boundary:
    """Where the early exit goes: `exit` (layer K-1's output) replaces `last` (layer N-1's output) in the nodes
    after the decoder layers (`readers`); `layer_of` maps each node inside a decoder layer to its index."""

    container: str
    layer_of: dict[torch.fx.Node, int]
    exit: torch.fx.Node
    last: torch.fx.Node
    readers: list[torch.fx.Node]


def _stack_paths(node: torch.fx.Node) -> list[str]:
    stack = node.meta.get("nn_module_stack") or {}
    # a node a pass made has no stack, or (after a re-export) only the root module's, path ''
    return [entry[0] for entry in stack.values() if isinstance(entry, tuple) and entry and entry[0]]


def _layer_container(graph: torch.fx.Graph, layers: int) -> str:
    """The module path of the decoder layers' list: the one prefix P with modules P.0 .. P.{layers-1} (and no
    other index) in the graph's module stacks. Nested lists (experts in a layer) have other prefixes."""
    indices: dict[str, set[int]] = {}
    for node in graph.nodes:
        for path in _stack_paths(node):
            match = _INDEXED.fullmatch(path)
            if match is not None:
                indices.setdefault(match.group(1), set()).add(int(match.group(2)))
    candidates = [prefix for prefix, seen in indices.items() if seen == set(range(layers))]
    if not indices:
        raise PassError(
            "draft_layers: the graph's nodes carry no module metadata (nn_module_stack), so its decoder layers "
            "cannot be told apart; run draft_layers first in the pipeline, on the graph torch.export captured"
        )
    if len(candidates) != 1:
        found = ", ".join(f"{p} ({len(s)})" for p, s in sorted(indices.items())) or "none"
        raise PassError(
            f"draft_layers: expected one module list with the config's {layers} decoder layers in the graph's "
            f"module metadata; found {'several' if candidates else 'none'} (lists and their sizes: {found})"
        )
    return candidates[0]


def _layer_of(node: torch.fx.Node, container: str) -> int | None:
    for path in _stack_paths(node):
        match = _INDEXED.fullmatch(path)
        if match is not None and match.group(1) == container:
            return int(match.group(2))
    return None


def _output_of(layer: int, layer_of: dict[torch.fx.Node, int]) -> torch.fx.Node:
    """The one node of `layer` read by nodes outside the layer (the residual stream it hands on)."""
    outputs = [
        node
        for node, index in layer_of.items()
        if index == layer and any(layer_of.get(user) != layer and user.op != "output" for user in node.users)
    ]
    if len(outputs) != 1:
        names = ", ".join(n.name for n in outputs) or "none"
        raise PassError(
            f"draft_layers: decoder layer {layer} should hand one tensor (its residual stream) to the nodes after "
            f"it; it hands {len(outputs)} ({names}). Run draft_layers first, before fusions merge layer boundaries"
        )
    if not _stack_paths(outputs[0]):
        raise PassError(
            f"draft_layers: the output of decoder layer {layer} is {outputs[0].name}, a node a pass made (a fusion "
            "across the layer's boundary); run draft_layers first, before fusions"
        )
    return outputs[0]


def _find_boundary(program: Program, layers: int) -> _Boundary:
    spec = program.spec
    if isinstance(layers, bool) or not isinstance(layers, int) or not 1 <= layers < spec.num_layers:
        raise PassError(
            f"draft_layers: option layers={layers!r}: must be an integer from 1 to {spec.num_layers - 1} "
            f"(the model has {spec.num_layers} decoder layers)"
        )
    graph = program.graph_module.graph
    container = _layer_container(graph, spec.num_layers)
    layer_of: dict[torch.fx.Node, int] = {}
    for node in graph.nodes:  # in topological order
        if node.op != "call_function":
            continue
        if _stack_paths(node):
            index = _layer_of(node, container)
        else:  # a node a pass added (kv_cache's attention): in the layer of its inputs
            index = max((layer_of[i] for i in node.all_input_nodes if i in layer_of), default=None)
        if index is not None:
            layer_of[node] = index
    last = _output_of(spec.num_layers - 1, layer_of)
    readers = [user for user in last.users if layer_of.get(user) is None and user.op != "output"]
    if not readers:
        raise PassError(f"draft_layers: nothing after the decoder layers reads the last layer's output {last.name}")
    return _Boundary(container, layer_of, _output_of(layers - 1, layer_of), last, readers)


def draft_layers(program: Program, layers: int | None = None) -> tuple[Program, dict[str, Any]]:
    spec = program.spec
    if layers is None:
        raise PassError("draft_layers: option layers (K, the decoder layers to keep) is required")
    boundary = _find_boundary(program, layers)
    gm = program.graph_module
    for reader in boundary.readers:
        reader.replace_input_with(boundary.last, boundary.exit)
    # a program with a KV cache returns every layer's updated cache: the dropped layers' are outputs no more
    output = gm.graph.output_node()
    kept = [
        (value, t)
        for value, t in zip(output.args[0], program.outputs, strict=True)
        if cache_layer(t.name) is None or cache_layer(t.name) < layers
    ]
    output.args = (tuple(value for value, _ in kept),)
    # the dropped layers' nodes go even where FX keeps unused nodes (SDPA counts as impure: it may draw dropout)
    dropped = {node for node, index in boundary.layer_of.items() if index >= layers}
    gm.graph.eliminate_dead_code(is_impure_node=lambda node: node not in dropped and node.is_impure())
    left = sorted({boundary.layer_of[n] for n in gm.graph.nodes if boundary.layer_of.get(n, -1) >= layers})
    if left:
        raise PassError(
            f"draft_layers: nodes of decoder layers {left} are still read after the early exit at layer "
            f"{layers - 1} (computation shared across layers); this model cannot be truncated by this pass"
        )
    dropped_inputs = []
    for node in list(gm.graph.nodes):
        index = cache_layer(str(node.target)) if node.op == "placeholder" else None
        if index is not None and index >= layers:
            if node.users:
                raise PassError(f"draft_layers: cache input {node.target} of a dropped layer is still read")
            gm.graph.erase_node(node)
            dropped_inputs.append(str(node.target))
    finish(gm)
    layer_types = spec.layer_types[:layers] if spec.layer_types is not None else None
    kv_widths = spec.kv_widths[:layers] if spec.kv_widths is not None else None
    truncated = dataclasses.replace(spec, num_layers=layers, layer_types=layer_types, kv_widths=kv_widths)
    inputs = [t for t in program.inputs if t.name not in dropped_inputs]
    outputs = [t for _, t in kept]
    signature_changed = len(inputs) != len(program.inputs) or len(outputs) != len(program.outputs)
    result = dataclasses.replace(
        program,
        spec=truncated,
        inputs=inputs,
        outputs=outputs,
        fresh_meta=program.fresh_meta and not signature_changed,
    )
    return result, {
        "layers_kept": layers,
        "layers_dropped": spec.num_layers - layers,
        "decoder_layers": boundary.container,
        "exit": boundary.exit.name,
        "cache_inputs_dropped": len(dropped_inputs),
    }


def _early_exit_reference(program: Program, inputs: Tensors, options: dict[str, Any]) -> Tensors:
    """The program before the pass, run by an FX interpreter that hands layer K-1's output to the nodes after the
    decoder layers in place of the last layer's: the untruncated graph with the early exit, for --verify."""
    boundary = _find_boundary(program, options["layers"])

    class EarlyExit(torch.fx.Interpreter):
        def run_node(self, node: torch.fx.Node) -> Any:
            value = super().run_node(node)
            # layer N-1's own nodes only feed the dropped layers' outputs, which are not compared
            return self.env[boundary.exit] if node is boundary.last else value

    with torch.no_grad():
        interpreter = EarlyExit(program.graph_module, garbage_collect_values=False)
        results = interpreter.run(*(inputs[n] for n in program.input_names))
    return dict(zip(program.output_names, results, strict=True))


register_pass(
    Pass(
        name="draft_layers",
        summary="keep the first K decoder layers + final norm + LM head: an early-exit self-draft (option layers)",
        explain=(
            "Speculative decoding's self-draft: the target's first K decoder layers, its final norm and LM head, "
            "so the draft shares the target's tokenizer and needs no training. Finds the decoder layers from the "
            "module metadata torch.export keeps on each node (the one module list with an entry per layer: "
            "model.layers.i, transformer.h.i, ...), feeds layer K-1's residual-stream output to the final norm in "
            "place of the last layer's, removes layers K.. and their weights (and, after kv_cache, their cache "
            "inputs and outputs), and sets the spec's layer count to K. Option layers (1 <= K < the model's "
            "layers). Run it first, on the captured graph: fusions merge nodes across layer boundaries and "
            "re-exports drop the metadata; it refuses a graph whose boundaries it cannot find. --verify compares "
            "with the program before the pass run with the same early exit (an FX interpreter), checking the "
            "surgery; the tests check the result against transformers with num_hidden_layers=K. Stats: layers "
            "kept and dropped, parameters before and after."
        ),
        run=draft_layers,
        verification=Verification(reference=_early_exit_reference),
    )
)
