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

import math
import operator
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.fx

from ..errors import PassError
from ..ir.causal_conv import CAUSAL_CONV1D
from ..ir.gated_delta_rule import GATED_DELTA_RULE, GATED_DELTA_STEP
from ..ir.program import Program, TensorSpec, fetch_attr
from ..ir.selective_scan import SELECTIVE_SCAN, SELECTIVE_STEP
from ..ir.ssd_scan import SSD_SCAN, SSD_STEP
from ..spec import DTYPE_BYTES
from ..step_io import STATE_KINDS, state_layer, state_name
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


@dataclass(frozen=True)
class Mixer:
    """A recurrent mixer found in the graph: the nodes it replaces (the last one's users take the new output), the
    state it keeps per sequence and how to call its stateful op."""

    kind: str  # step_io.STATE_KINDS
    nodes: tuple[torch.fx.Node, ...]
    state_shape: tuple[int, ...]  # one sequence's
    state_dtype: str
    call: Callable[[torch.fx.Graph, torch.fx.Node, torch.fx.Node, torch.fx.Node], torch.fx.Node]


def _conv_mixer(gm: torch.fx.GraphModule, node: torch.fx.Node, dtype: str) -> Mixer | None:
    found = _causal_conv(gm, node)
    if found is None:
        return None
    x, cut = found
    weight = node.args[1]
    channels, _, width = _value(gm, weight).shape
    bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")

    def call(graph: torch.fx.Graph, state: torch.fx.Node, past: torch.fx.Node, lens: torch.fx.Node) -> torch.fx.Node:
        squeezed = graph.call_function(aten.squeeze.dim, (weight, 1))
        return graph.call_function(CAUSAL_CONV1D.overload, (x, squeezed, bias, state, past, lens))

    return Mixer("conv", (node, cut), (int(channels), int(width) - 1), dtype, call)


def _delta_mixer(gm: torch.fx.GraphModule, node: torch.fx.Node, dtype: str) -> Mixer | None:
    if node.op != "call_function" or node.target is not GATED_DELTA_RULE.overload:
        return None
    q, k, v, g, beta, use_qk_l2norm = node.args
    heads, dk, dv = tensor_meta(v).shape[2], tensor_meta(k).shape[3], tensor_meta(v).shape[3]

    def call(graph: torch.fx.Graph, state: torch.fx.Node, past: torch.fx.Node, lens: torch.fx.Node) -> torch.fx.Node:
        return graph.call_function(GATED_DELTA_STEP.overload, (q, k, v, g, beta, state, past, lens, use_qk_l2norm))

    return Mixer("delta", (node,), (int(heads), int(dk), int(dv)), "float32", call)


def _ssd_mixer(gm: torch.fx.GraphModule, node: torch.fx.Node, dtype: str) -> Mixer | None:
    if node.op != "call_function" or node.target is not SSD_SCAN.overload:
        return None
    x, dt, A, B, C, D, dt_bias, *options = node.args
    _, _, heads, head_dim = tensor_meta(x).shape

    def call(graph: torch.fx.Graph, state: torch.fx.Node, past: torch.fx.Node, lens: torch.fx.Node) -> torch.fx.Node:
        return graph.call_function(SSD_STEP.overload, (x, dt, A, B, C, D, dt_bias, state, past, lens, *options))

    return Mixer("ssm", (node,), (int(heads), int(head_dim), int(tensor_meta(B).shape[-1])), "float32", call)


def _selective_mixer(gm: torch.fx.GraphModule, node: torch.fx.Node, dtype: str) -> Mixer | None:
    if node.op != "call_function" or node.target is not SELECTIVE_SCAN.overload:
        return None
    x, dt, A, B, C, D, z, dt_bias, softplus = node.args
    channels, state_size = _value(gm, A).shape

    def call(graph: torch.fx.Graph, state: torch.fx.Node, past: torch.fx.Node, lens: torch.fx.Node) -> torch.fx.Node:
        args = (x, dt, A, B, C, D, z, dt_bias, state, past, lens, softplus)
        return graph.call_function(SELECTIVE_STEP.overload, args)

    return Mixer("ssm", (node,), (int(channels), int(state_size)), "float32", call)


MIXERS = (_conv_mixer, _delta_mixer, _ssd_mixer, _selective_mixer)


def state_cache(program: Program) -> tuple[Program, dict[str, Any]]:
    if any(state_layer(name) is not None for name in program.input_names):
        raise PassError("state_cache: the program already carries recurrent state")
    program = program.with_fresh_meta()
    gm = program.graph_module
    graph = gm.graph
    dtype = program.spec.dtype
    mixers = [m for node in graph.nodes for find in MIXERS if (m := find(gm, node, dtype)) is not None]
    counts = {kind: sum(m.kind == kind for m in mixers) for kind in STATE_KINDS}
    if not mixers:
        return program, counts
    past_lens, input_lens, new_inputs = step_lengths(program)
    new_outputs: list[torch.fx.Node] = []
    output_specs: list[TensorSpec] = []
    state_bytes = 0
    for index, mixer in enumerate(mixers):
        first, last = mixer.nodes[0], mixer.nodes[-1]
        layer = decoder_layer(first)
        name = state_name(mixer.kind, index if layer is None else layer)
        if name in {t.name for t in new_inputs}:
            raise PassError(f"state_cache: {first.name} is a second {mixer.kind} mixer in layer {layer}")
        spec = TensorSpec(name, mixer.state_dtype, ("batch", *mixer.state_shape))
        state = add_input(graph, name)
        with graph.inserting_before(last):
            call = mixer.call(graph, state, past_lens, input_lens)
            out, updated = (graph.call_function(operator.getitem, (call, i)) for i in range(2))
        replace_uses([last], [out])
        for node in reversed(mixer.nodes):
            graph.erase_node(node)
        new_inputs.append(spec)
        new_outputs.append(updated)
        output_specs.append(spec)
        state_bytes += math.prod(mixer.state_shape) * DTYPE_BYTES[mixer.state_dtype]
    output = graph.output_node()
    output.args = (tuple(output.args[0]) + tuple(new_outputs),)
    finish(gm)
    rewritten = program.with_signature(program.inputs + new_inputs, program.outputs + output_specs)
    rewritten.spec = replace(program.spec, state_bytes=program.spec.state_bytes + state_bytes)
    return rewritten, {**counts, "layers": [state_layer(t.name) for t in output_specs]}


register_pass(
    Pass(
        name="state_cache",
        summary="recurrent mixers (short convolutions, Gated DeltaNet, Mamba) -> ops over a per-sequence state",
        explain=(
            "Matches every aten.conv1d that is depthwise (groups = channels, weight [C, 1, W]), stride and "
            "dilation 1, padded by W - 1, and read only through a slice back to its input's length: a causal "
            "convolution, however the model wrote it. Replaces it with llmlower::causal_conv1d over the step's new "
            "tokens and conv_state_<layer> [batch, C, W - 1] (the sequence's last W - 1 inputs). Each captured "
            "llmlower::gated_delta_rule becomes gated_delta_step over delta_state_<layer> [batch, hv, dk, dv] "
            "(float32), and each captured llmlower::ssd_scan (Mamba-2) ssd_step over ssm_state_<layer> [batch, "
            "heads, head_dim, state_size] (float32), and each llmlower::selective_scan (Mamba) selective_step over "
            "ssm_state_<layer> [batch, channels, state_size]. A state is zeros where past_lens is 0; the updated "
            "states are returned. Adds past_lens and input_lens when the program has none. Leaves a program "
            "without such mixers unchanged."
        ),
        run=state_cache,
    )
)
