"""state_cache: the recurrent mixers of hybrid models carry a fixed-size state per sequence across steps.

A model with short convolutions (LFM2's mixer, the conv in front of Mamba's scans and Gated DeltaNet's delta rule)
is captured without a cache as a depthwise conv1d padded by width - 1 on both sides and cut to the input's length:
the causal convolution over the whole prompt. This pass finds that pattern in the graph, whatever module wrote it,
and replaces it with `causal_conv1d` over the step's new tokens and the sequence's conv state (its last width - 1
inputs), an input and an updated output of the step like a KV cache. A prompt in chunks and decode one token at a
time then compute what the whole prompt at once does. Runs before kv_cache: the layers it gives a state are those
kv_cache expects no attention in.
"""

from __future__ import annotations

import operator
from dataclasses import replace
from typing import Any

import torch
import torch.fx

from ..errors import PassError
from ..ir.causal_conv import CAUSAL_CONV1D
from ..ir.program import Program, TensorSpec, fetch_attr
from ..step_io import state_layer, state_name
from .graph_utils import add_input, decoder_layer, finish, replace_uses, step_lengths, tensor_meta
from .registry import Pass, register_pass

aten = torch.ops.aten
CONV1D = aten.conv1d.default
SLICE = aten.slice.Tensor


def _same_size(a: Any, b: Any) -> bool:
    """Two (possibly symbolic) sizes are the same: equal ints, or the same symbol."""
    return str(a) == str(b)


def _value(gm: torch.fx.GraphModule, node: torch.fx.Node) -> torch.Tensor | None:
    """A node's recorded value, or the tensor itself for a weight (get_attr)."""
    return fetch_attr(gm, node.target) if node.op == "get_attr" else tensor_meta(node)


def _causal_conv(gm: torch.fx.GraphModule, node: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node] | None:
    """(input, the slice that cuts the output to the input's length) when `node` is a depthwise conv1d padded by
    width - 1 on each side and read only through that slice: a causal convolution. None for any other node."""
    if node.op != "call_function" or node.target is not CONV1D or len(node.users) != 1:
        return None
    names = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
    args = dict(zip(names, node.args, strict=False)) | dict(node.kwargs)
    x, weight = _value(gm, args["input"]), _value(gm, args["weight"])
    if x is None or weight is None or x.dim() != 3 or weight.dim() != 3:
        return None
    channels, one, width = weight.shape
    depthwise = one == 1 and args.get("groups", 1) == channels == x.shape[1]
    unit = list(args.get("stride", [1])) == [1] and list(args.get("dilation", [1])) == [1]
    if not (depthwise and unit and list(args.get("padding", [0])) == [width - 1]):
        return None
    (cut,) = node.users
    if cut.op != "call_function" or cut.target is not SLICE or cut.args[1:3] not in ((2, 0), (2, None), (-1, 0)):
        return None
    out = tensor_meta(cut)
    return (args["input"], cut) if out is not None and _same_size(out.shape[-1], x.shape[-1]) else None


def state_cache(program: Program) -> tuple[Program, dict[str, Any]]:
    if any(state_layer(name) is not None for name in program.input_names):
        raise PassError("state_cache: the program already carries recurrent state")
    program = program.with_fresh_meta()
    gm = program.graph_module
    graph = gm.graph
    sites = [(node, found) for node in graph.nodes if (found := _causal_conv(gm, node)) is not None]
    if not sites:
        return program, {"convolutions": 0}
    past_lens, input_lens, new_inputs = step_lengths(program)
    new_outputs: list[torch.fx.Node] = []
    output_specs: list[TensorSpec] = []
    for index, (conv, (x, cut)) in enumerate(sites):
        layer = decoder_layer(conv)
        layer = index if layer is None else layer
        name = state_name("conv", layer)
        if any(t.name == name for t in new_inputs):
            raise PassError(f"state_cache: {conv.name} is a second short convolution in layer {layer}")
        channels, _, width = _value(gm, conv.args[1]).shape
        shape = ("batch", int(channels), int(width) - 1)
        state = add_input(graph, name)
        new_inputs.append(TensorSpec(name, program.spec.dtype, shape))
        bias = conv.args[2] if len(conv.args) > 2 else conv.kwargs.get("bias")
        with graph.inserting_before(cut):
            weight = graph.call_function(aten.squeeze.dim, (conv.args[1], 1))
            call = graph.call_function(CAUSAL_CONV1D.overload, (x, weight, bias, state, past_lens, input_lens))
            out, updated = (graph.call_function(operator.getitem, (call, i)) for i in range(2))
        replace_uses([cut], [out])
        graph.erase_node(cut)
        graph.erase_node(conv)
        new_outputs.append(updated)
        output_specs.append(TensorSpec(name, program.spec.dtype, shape))
    output = graph.output_node()
    output.args = (tuple(output.args[0]) + tuple(new_outputs),)
    finish(gm)
    rewritten = program.with_signature(program.inputs + new_inputs, program.outputs + output_specs)
    layers = [state_layer(t.name) for t in output_specs]
    elements = sum(int(t.shape[1]) * int(t.shape[2]) for t in output_specs)
    rewritten.spec = replace(program.spec, state_elements=program.spec.state_elements + elements)
    return rewritten, {"convolutions": len(sites), "layers": layers}


register_pass(
    Pass(
        name="state_cache",
        summary="causal depthwise conv1d -> `causal_conv1d` over a per-sequence conv state (hybrid models)",
        explain=(
            "Matches every aten.conv1d that is depthwise (groups = channels, weight [C, 1, W]), stride and "
            "dilation 1, padded by W - 1, and read only through a slice back to its input's length: a causal "
            "convolution, however the model wrote it. Replaces it with llmlower::causal_conv1d over the step's new "
            "tokens and conv_state_<layer> [batch, C, W - 1] (the sequence's last W - 1 inputs; zeros where "
            "past_lens is 0), returns the updated state. Adds past_lens and input_lens when the program has none. "
            "Leaves a program without such convolutions unchanged."
        ),
        run=state_cache,
    )
)
