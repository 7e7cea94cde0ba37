"""kv_cache: every scaled_dot_product_attention (or captured `causal_attention`) becomes `attention` over a
cache of the kv heads only.

The pass works at the attention node, whatever computed q, k and v: it follows k and v back through the
model's repeat-kv spelling (unsqueeze + expand + reshape, repeat_interleave, or SDPA's enable_gqa) to the
tensors with kv_heads heads, and feeds those to the cache. `causal_attention` (frontend/attention_capture.py)
already has kv heads and carries its extras (window, softcap, sinks, alibi_slopes), which go into `attention` as
they are.
Masks become dead (the op is causal over the cache) and are removed. The program gains inputs past_lens,
input_lens and one k/v cache pair per layer (each of its own head size), and returns the updated caches after
the logits: prefill and decode are this one graph. In a hybrid model, whose other layers keep a recurrent state
(state_cache runs first), each cache is named by its node's decoder layer. Positions the model counted itself
as arange(tokens) become the step's position_ids (token_positions.py).
"""

from __future__ import annotations

import math
import operator
from dataclasses import replace
from typing import Any

import torch
import torch.fx

from ..errors import PassError
from ..ir.attention import ATTENTION
from ..ir.causal_attention import CAUSAL_ATTENTION
from ..ir.program import Program, TensorSpec, cache_names
from ..step_io import cache_layer, state_layer
from .graph_utils import RESHAPES, add_input, decoder_layer, finish, replace_uses, step_lengths, tensor_meta
from .registry import Pass, register_pass
from .token_positions import positions_from_arange

aten = torch.ops.aten
SDPA = aten.scaled_dot_product_attention.default
_REPEAT_INTERLEAVE = {aten.repeat_interleave.self_int}


def _heads(node: torch.fx.Node) -> int:
    value = tensor_meta(node)
    if value is None or value.dim() != 4:
        raise PassError(f"kv_cache: node {node.name} has no 4-d shape metadata (re-export the program first)")
    return int(value.shape[1])


def _kv_source(node: torch.fx.Node) -> torch.fx.Node:
    """The tensor a repeat-kv produced `node` from, or `node` itself when it is not a repeat."""
    if node.op != "call_function":
        return node
    if node.target in _REPEAT_INTERLEAVE and node.args[2:3] == (1,):
        return node.args[0]
    if node.target in RESHAPES:
        expand = node.args[0]
        if expand.op == "call_function" and expand.target is aten.expand.default:
            unsqueeze = expand.args[0]
            if (
                unsqueeze.op == "call_function"
                and unsqueeze.target is aten.unsqueeze.default
                and unsqueeze.args[1] == 2
            ):
                return unsqueeze.args[0]
    return node


def _sdpa_arguments(node: torch.fx.Node) -> dict[str, Any]:
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
    args = dict(zip(names, node.args, strict=False))
    args.update(node.kwargs)
    if args.get("dropout_p", 0.0):
        raise PassError(f"kv_cache: {node.name} applies dropout {args['dropout_p']}; capture in eval mode")
    return args


def _causal_attention_arguments(node: torch.fx.Node) -> dict[str, Any]:
    """`causal_attention`'s arguments under SDPA's names (q, k, v, scale), plus its extras by their own names
    (torch.export leaves out those at their defaults)."""
    names = ("query", "key", "value", "scale", "window", "softcap", "sinks", "alibi_slopes")
    args = dict(zip(names, node.args, strict=False))
    args.update(node.kwargs)
    return args


def _attention_sites(graph: torch.fx.Graph) -> list[tuple[torch.fx.Node, dict[str, Any]]]:
    """Every attention node of the graph, in order, with its arguments by name."""
    readers = {SDPA: _sdpa_arguments, CAUSAL_ATTENTION.overload: _causal_attention_arguments}
    return [(n, readers[n.target](n)) for n in graph.nodes if n.op == "call_function" and n.target in readers]


def _site_layers(sites: list[tuple[torch.fx.Node, dict[str, Any]]], layers: int, recurrent: bool) -> list[int]:
    """The decoder layer of each attention node: in order, one per layer, in a model of attention layers only; in a
    `recurrent` (hybrid) model, whose other layers keep a state, the layer torch.export recorded for each node."""
    if not recurrent:
        if len(sites) != layers:
            raise PassError(f"kv_cache: found {len(sites)} attention nodes, the config says {layers} layers")
        return list(range(layers))
    found = [decoder_layer(site) for site, _ in sites]
    if None in found or len(set(found)) != len(found) or max(found, default=0) >= layers:
        raise PassError(
            f"kv_cache: the {len(sites)} attention nodes of this hybrid model do not name one decoder layer each "
            f"({found}); re-capture the model with frontend.capture"
        )
    return found


def kv_cache(program: Program) -> tuple[Program, dict[str, Any]]:
    if any(cache_layer(name) is not None for name in program.input_names):
        raise PassError("kv_cache: the program already has a KV cache")
    program = program.with_fresh_meta()
    spec = program.spec
    gm = program.graph_module
    graph = gm.graph
    sites = _attention_sites(graph)
    recurrent = any(state_layer(name) is not None for name in program.input_names)
    if not sites and not recurrent:
        raise PassError(
            "kv_cache: the graph has no scaled_dot_product_attention or causal_attention "
            "(load the model with frontend.load, which picks SDPA or llmlower's attention capture)"
        )
    site_layers = _site_layers(sites, spec.num_layers, recurrent)
    past_lens, input_lens, new_inputs = step_lengths(program)
    new_outputs: list[torch.fx.Node] = []
    output_specs: list[TensorSpec] = []
    heads = spec.num_heads

    for layer, (site, args) in zip(site_layers, sites, strict=True):
        query, key, value = args["query"], args["key"], args["value"]
        heads = _heads(query)
        key, value = _kv_source(key), _kv_source(value)
        kv_heads = _heads(key)
        if kv_heads != spec.num_kv_heads or _heads(value) != kv_heads or heads % kv_heads:
            raise PassError(
                f"kv_cache: {site.name} (layer {layer}) reads keys with {kv_heads} heads; expected the "
                f"{spec.num_kv_heads} kv heads of the config (the repeat-kv spelling was not recognised)"
            )
        head_dim = int(tensor_meta(query).shape[-1])
        scale = args.get("scale") or 1.0 / math.sqrt(head_dim)
        window = args.get("window", spec.window_for_layer(layer))
        if window != spec.window_for_layer(layer):
            raise PassError(
                f"kv_cache: {site.name} (layer {layer}) attends over a window of {window}, the config says "
                f"{spec.window_for_layer(layer)}"
            )
        cache_shapes = [("batch", kv_heads, "context", int(tensor_meta(x).shape[-1])) for x in (key, value)]

        k_cache, v_cache = (add_input(graph, name) for name in cache_names(layer))
        new_inputs += [
            TensorSpec(n, spec.dtype, shape) for n, shape in zip(cache_names(layer), cache_shapes, strict=True)
        ]
        with graph.inserting_before(site):
            call = graph.call_function(
                ATTENTION.overload,
                (
                    query,
                    key,
                    value,
                    k_cache,
                    v_cache,
                    past_lens,
                    input_lens,
                    float(scale),
                    window,
                    float(args.get("softcap", 0.0)),
                    args.get("sinks"),
                    args.get("alibi_slopes"),
                ),
            )
            results = [graph.call_function(operator.getitem, (call, i)) for i in range(3)]
        replace_uses([site], [results[0]])
        graph.erase_node(site)
        new_outputs += results[1:]
        output_specs += [
            TensorSpec(n, spec.dtype, shape) for n, shape in zip(cache_names(layer), cache_shapes, strict=True)
        ]

    output = graph.output_node()
    output.args = (tuple(output.args[0]) + tuple(new_outputs),)
    graph.eliminate_dead_code()  # the masks' aranges go: those left count the tokens of a step
    counted = positions_from_arange(gm)
    finish(gm)
    rewritten = program.with_signature(program.inputs + new_inputs, program.outputs + output_specs)
    rewritten.spec = replace(spec, kv_widths=cache_widths(new_inputs, spec.num_layers))
    stats = {"matches": len(sites), "kv_heads": spec.num_kv_heads, "heads": heads}
    return rewritten, stats | ({"positions_from_arange": counted} if counted else {})


def cache_widths(inputs: list[TensorSpec], layers: int) -> tuple[int, ...]:
    """Per layer, the elements one token adds to its caches: heads x head size of each (ModelSpec.kv_widths)."""
    widths = [0] * layers
    for t in inputs:
        layer = cache_layer(t.name)
        if layer is not None:
            widths[layer] += int(t.shape[1]) * int(t.shape[3])
    return tuple(widths)


register_pass(
    Pass(
        name="kv_cache",
        summary="SDPA -> `attention` over a kv-heads-only cache; prefill and decode in one graph",
        explain=(
            "Matches every aten.scaled_dot_product_attention and llmlower::causal_attention (the capture of "
            "models transformers runs only eagerly, e.g. Gemma 2, gpt-oss; its softcap and sinks are passed on). "
            "Follows its key and value back through "
            "repeat-kv (unsqueeze(2) + expand + reshape, or repeat_interleave on dim 1) to the tensors with "
            "the config's kv_heads, and replaces the node with llmlower::attention reading and appending a "
            "cache [batch, kv_heads, context, head_dim] per layer. Adds inputs past_lens and input_lens "
            "[batch] (right-padded new tokens) and the caches, returns the updated caches. The attention "
            "mask construction becomes dead and is removed. Sliding windows come from the config. In a hybrid "
            "model (state_cache gave some layers a recurrent state) each attention's cache is named by the decoder "
            "layer torch.export recorded for it."
        ),
        run=kv_cache,
    )
)
