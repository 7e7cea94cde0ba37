"""latent_cache: multi-head latent attention (DeepSeek's MLA) caches its latent, not keys and values per head.

After kv_cache, an MLA layer's `attention` reads keys and values expanded from a per-token latent: each head's
value, and the first part of its key, are slices of one linear map of the latent (kv_b_proj, no bias) viewed
per head, and the rest of the key is one tensor with a single head broadcast to every head (the rotary key
k_pe). The pass finds that shape of graph at each attention node, whatever the modules are called: the value
back through its last-dimension slice, the per-head view and transpose to the linear and its input (the
latent, after DeepSeek's kv_a_layernorm), the key's parts (a cat, or torch.export's new_empty filled by copy_
into slices) to the same projection's other slice and the expanded single-head k_pe (after its rope). Such a
node becomes `latent_attention` over the layer's caches holding the latent and k_pe (k_cache_<i>: latent
[batch, 1, context, rank], v_cache_<i>: k_pe [batch, 1, context, rope]); the expansion becomes dead. Attention
nodes of any other shape stay as they are, so the pass does nothing on models without MLA.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.fx

from ..errors import PassError
from ..ir import ATTENTION, LATENT_ATTENTION
from ..ir.program import PAST_LENS, POSITION_IDS, Program, TensorSpec, example_inputs
from ..step_io import LOGITS, cache_layer, cache_names
from .graph_utils import finish, tensor_meta
from .kv_cache import cache_widths
from .registry import Pass, Verification, register_pass

aten = torch.ops.aten
_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}


@dataclass(frozen=True)
class Projection:
    """Keys and values made per head from a latent: transpose(view(linear(latent, weight), [b, t, heads,
    width]), 1, 2), each head's `width` holding its key part, then its value."""

    node: torch.fx.Node  # the per-head tensor [b, heads, t, width]
    latent: torch.fx.Node
    weight: torch.fx.Node
    heads: int
    width: int


def _call(node: Any, targets: set | Any) -> bool:
    targets = targets if isinstance(targets, set) else {targets}
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in targets


def _last_dim(node: torch.fx.Node, dim: int) -> bool:
    value = tensor_meta(node)
    return value is not None and dim in (-1, value.dim() - 1)


def _slice(node: torch.fx.Node) -> tuple[torch.fx.Node, int, int] | None:
    """(source, start, end) when `node` is a slice of its source's last dimension: split_with_sizes' getitem,
    or aten.slice with step 1."""
    if _call(node, operator.getitem) and _call(node.args[0], aten.split_with_sizes.default):
        split = node.args[0]
        source, sizes = split.args[0], split.args[1]
        dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
        if _last_dim(source, dim):
            start = sum(sizes[: node.args[1]])
            return source, start, start + sizes[node.args[1]]
    if _call(node, aten.slice.Tensor) and len(node.args) >= 4 and node.args[4:5] in ((), (1,)):
        source, dim, start, end = node.args[:4]
        if _last_dim(source, dim):
            return source, start, min(end, int(tensor_meta(source).shape[-1]))
    return None


def _projection(node: torch.fx.Node) -> Projection | None:
    """The Projection `node` is, if it is one (a bias-free linear of a constant weight)."""
    if not (_call(node, aten.transpose.int) and sorted(node.args[1:3]) == [1, 2]):
        return None
    view = node.args[0]
    if not (_call(view, _VIEWS) and _call(view.args[0], aten.linear.default)):
        return None
    linear = view.args[0]
    latent, weight = linear.args[:2]
    if linear.args[2:3] not in ((), (None,)) or weight.op != "get_attr":
        return None
    value, source = tensor_meta(node), tensor_meta(latent)
    if value is None or source is None or not (source.dim() == 3 or (source.dim() == 4 and source.shape[1] == 1)):
        return None
    return Projection(node, latent, weight, int(value.shape[1]), int(value.shape[-1]))


def _key_parts(key: torch.fx.Node) -> tuple[list[tuple[int, torch.fx.Node]], list[torch.fx.Node]] | None:
    """The key's parts along its last dimension as (start, tensor), and the nodes that assemble it only (to erase
    with it): a cat, or new_empty with each part copied into a slice of it."""
    if _call(key, aten.cat.default) and _last_dim(key, key.args[1] if len(key.args) > 1 else 0):
        starts, parts = 0, []
        for part in key.args[0]:
            parts.append((starts, part))
            starts += int(tensor_meta(part).shape[-1])
        return parts, []
    if not _call(key, aten.new_empty.default):
        return None
    parts, nodes = [], []
    for user in key.users:
        if user.op == "call_function" and user.target is ATTENTION.overload:
            continue
        where = _slice(user)
        copies = list(user.users)
        if where is None or len(copies) != 1 or not _call(copies[0], aten.copy_.default):
            return None
        parts.append((where[1], copies[0].args[1]))
        nodes += [copies[0], user]
    return sorted(parts, key=lambda p: p[0]), nodes


def _shared_head(node: torch.fx.Node, heads: int) -> torch.fx.Node | None:
    """The single-head tensor [b, 1, t, d] that `node` broadcasts to `heads` heads, if it does."""
    if _call(node, aten.expand.default):
        source = tensor_meta(node.args[0])
        if source is not None and source.dim() == 4 and source.shape[1] == 1 and tensor_meta(node).shape[1] == heads:
            return node.args[0]
    return None


@dataclass(frozen=True)
class LatentSite:
    """One MLA attention node: its projection, the shared rotary key and the key's assembly nodes."""

    node: torch.fx.Node
    projection: Projection
    k_pe: torch.fx.Node
    assembly: list[torch.fx.Node]
    nope: int


def _latent_site(node: torch.fx.Node) -> LatentSite | None:
    """The MLA reading of an `attention` node, or None when its keys and values are not made from a latent."""
    query, key, value = node.args[:3]
    extras = dict(zip(("window", "softcap", "sinks"), node.args[8:], strict=False))
    if extras.get("softcap") or extras.get("sinks") is not None:
        return None
    value_slice = _slice(value)
    projection = _projection(value_slice[0]) if value_slice else None
    parts = _key_parts(key)
    if projection is None or parts is None or len(parts[0]) != 2 or value_slice[2] != projection.width:
        return None
    (nope_start, nope_part), (pe_start, pe_part) = parts[0]
    nope_slice, k_pe = _slice(nope_part), _shared_head(pe_part, projection.heads)
    nope = value_slice[1]
    if nope_slice != (projection.node, 0, nope) or nope_start != 0 or pe_start != nope or k_pe is None:
        return None
    if int(tensor_meta(query).shape[-1]) != nope + int(tensor_meta(k_pe).shape[-1]):
        return None
    return LatentSite(node, projection, k_pe, parts[1], nope)


def _as_single_head(graph: torch.fx.Graph, latent: torch.fx.Node) -> torch.fx.Node:
    """The latent as [b, 1, t, rank] (it is that already, or [b, t, rank])."""
    return latent if tensor_meta(latent).dim() == 4 else graph.call_function(aten.unsqueeze.default, (latent, 1))


def latent_cache(program: Program) -> tuple[Program, dict[str, Any]]:
    if program.kv_layout is None:
        raise PassError("latent_cache: run kv_cache first (the pass rewrites its attention nodes and caches)")
    gm = program.graph_module  # the nodes the pattern reads keep their capture's metadata: no re-export
    graph = gm.graph
    nodes = graph.find_nodes(op="call_function", target=ATTENTION.overload)
    sites = [site for site in map(_latent_site, nodes) if site is not None]
    shapes: dict[str, tuple[str | int, ...]] = {}
    for site in sites:
        q, _, _, k_cache, v_cache, past_lens, input_lens, scale = site.node.args[:8]
        window = site.node.args[8] if len(site.node.args) > 8 else 0
        with graph.inserting_before(site.node):
            latent = _as_single_head(graph, site.projection.latent)
            call = graph.call_function(
                LATENT_ATTENTION.overload,
                (q, latent, site.k_pe, site.projection.weight, k_cache, v_cache, past_lens, input_lens, scale, window),
            )
        site.node.replace_all_uses_with(call)
        graph.erase_node(site.node)
        for assembled in site.assembly:
            graph.erase_node(assembled)
        rank, rope = int(tensor_meta(site.projection.latent).shape[-1]), int(tensor_meta(site.k_pe).shape[-1])
        shapes[k_cache.target], shapes[v_cache.target] = ("batch", 1, "context", rank), ("batch", 1, "context", rope)
    if not sites:
        return program, {"matches": 0}
    finish(gm)

    def relaid(t: TensorSpec) -> TensorSpec:
        return TensorSpec(t.name, t.dtype, shapes[t.name]) if t.name in shapes else t

    inputs, outputs = [relaid(t) for t in program.inputs], [relaid(t) for t in program.outputs]
    rewritten = program.with_signature(inputs, outputs)
    before, rewritten.spec = (
        program.spec.kv_bytes_per_token(),
        replace(program.spec, kv_widths=cache_widths(inputs, program.spec.num_layers)),
    )
    return rewritten, {
        "matches": len(sites),
        "kv_bytes_per_token_before": before,
        "kv_bytes_per_token": rewritten.spec.kv_bytes_per_token(),
    }


def _prefill_inputs(program: Program, options: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Inputs for verification: prompts from empty caches (the expanded and the latent caches then hold the
    same computation: nothing), right-padded."""
    inputs = example_inputs(program, batch=3, tokens=6, context=16, seed=4321)
    inputs[PAST_LENS] = torch.zeros(3, dtype=torch.int64)
    inputs[POSITION_IDS] = torch.arange(6)[None, :].expand(3, -1)
    for name, value in inputs.items():
        if cache_layer(name) is not None:
            inputs[name] = torch.zeros_like(value)
    return inputs


def _run_latent(program: Program, inputs: dict[str, torch.Tensor], options: dict[str, Any]) -> dict:
    """The rewritten program's logits on the same prompts, from empty latent caches."""
    context = inputs[cache_names(0)[0]].shape[2]
    tensors = {name: value for name, value in inputs.items() if cache_layer(name) is None}
    for t in program.inputs:
        if cache_layer(t.name) is not None:
            tensors[t.name] = torch.zeros(3, t.shape[1], context, t.shape[3], dtype=getattr(torch, t.dtype))
    return {LOGITS: program(**tensors)[LOGITS]}


register_pass(
    Pass(
        name="latent_cache",
        summary="MLA (DeepSeek) attention -> `latent_attention` caching the latent and rotary key, weight-absorbed",
        explain=(
            "Runs after kv_cache. Matches each attention whose value is a last-dimension slice of "
            "transpose(view(linear(latent, W), [b, t, heads, nope + dv]), 1, 2) (a bias-free linear, W constant) and "
            "whose key is that projection's [0, nope) slice followed by a single-head tensor k_pe expanded to every "
            "head (a cat, or new_empty filled by copy_). It becomes llmlower::latent_attention(q, latent, k_pe, W, "
            "...) over caches of the latent [batch, 1, context, rank] (k_cache_<i>) and k_pe [batch, 1, context, "
            "rope] (v_cache_<i>): the query's non-rotary part is absorbed into the latent space through W's key "
            "rows, the output leaves it through W's value rows. The spec's kv_widths follow. Any other attention "
            "node stays. --verify compares the logits of prompts from empty caches."
        ),
        run=latent_cache,
        verification=Verification(inputs=_prefill_inputs, run=_run_latent),
    )
)
