"""eager_attention: attention that a model writes out in aten ops (softmax(f(q·kᵀ))·v) becomes `causal_attention`.

Models that bypass transformers' attention interface (Bloom, whose ALiBi is a baddbmm of a per-head bias; any
model loaded with transformers' "eager" implementation) reach the graph as a matmul (bmm, baddbmm) of q and kᵀ, a
few elementwise ops, a softmax over the keys and a matmul with v. Each softmax whose logits come from one such
product is a site: its q, k and v are followed back through shape ops to their [batch, heads, tokens, head_dim]
tensors, and f is not read off the ops but measured on a run of the program (batch 2, 7 tokens): the logits with
q·kᵀ replaced by constants p give f(p) + bias. f must be p * scale, or softcap * tanh(p * scale / softcap) (its
curvature found where it bends, then checked at every probe); the bias (q·kᵀ = 0) must mask exactly the keys
causal attention with the config's window hides, and elsewhere be slope_h * key position plus a constant per row
(ALiBi; softmax is unchanged by the constant, so this is slope_h * (key - query) as `attention` adds it). The
bias may depend on positions and sizes only, never on the tokens. Last, the site's recorded output must equal
`causal_attention`'s on the recorded q, k and v. A site that fails any of these is refused in one line naming its
softmax node; the slopes become a constant of the program.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.fx

from ..errors import PassError
from ..ir.attention import alibi_bias, attend, visible
from ..ir.causal_attention import CAUSAL_ATTENTION
from ..ir.program import INPUT_IDS, Program, example_inputs
from .graph_utils import RESHAPES, finish, replace_uses, tensor_meta
from .registry import Pass, register_pass

aten = torch.ops.aten
SOFTMAX = {aten.softmax.int, aten._softmax.default, aten._safe_softmax.default}
SCORES = {aten.bmm.default, aten.matmul.default, aten.baddbmm.default}  # q·kᵀ (baddbmm: plus a bias)
WEIGHTED = {aten.bmm.default, aten.matmul.default}  # weights·v
SIZES = {aten.sym_size.int, aten.sym_numel.default, aten.sym_stride.int}
_CASTS = {aten.to.dtype, aten._to_copy.default, aten.clone.default, aten.contiguous.default, aten.alias.default}
# ops between a tensor and a reshaped view of it, which q, k and v are followed back through
_SHAPES = RESHAPES | _CASTS | {aten.transpose.int, aten.permute.default, aten.expand.default, aten.unsqueeze.default}
# ops that may lie between q·kᵀ and the softmax: f and the bias
_ELEMENTWISE = {
    aten.add.Tensor,
    aten.sub.Tensor,
    aten.mul.Tensor,
    aten.div.Tensor,
    aten.tanh.default,
    aten.masked_fill.Scalar,
    aten.where.self,
    aten.where.ScalarOther,
}
_WEIGHTS_PATH = RESHAPES | _CASTS | {aten.dropout.default}  # softmax -> weights·v (dropout: eval mode)
BATCH, TOKENS = 2, 7  # the recorded run
PROBES = [2.0**k for k in range(41)]  # the constants q·kᵀ is replaced by (those whose square the dtype holds)
BENT = 1.7  # f(2p) / f(p) where a soft-cap is fitted: tanh has bent enough for a well-conditioned fit
MASKED = 1 / 64  # a bias below this fraction of its dtype's lowest value hides its key (a mask, maybe scaled)


@dataclass
class Site:
    """One eager attention: its softmax, the q·kᵀ product, q/k/v [batch, heads, tokens, dim] and the node holding
    the output [batch, heads, tokens, dv]."""

    softmax: torch.fx.Node
    scores: torch.fx.Node
    q: torch.fx.Node
    k: torch.fx.Node
    v: torch.fx.Node
    out: torch.fx.Node


def _token_dependent(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """The nodes whose values depend on the token ids (not through their sizes alone)."""
    dependent: set[torch.fx.Node] = set()
    for node in graph.nodes:
        tokens = node.op == "placeholder" and node.target == INPUT_IDS
        computed = node.op == "call_function" and node.target not in SIZES
        if tokens or (computed and any(i in dependent for i in node.all_input_nodes)):
            dependent.add(node)
    return dependent


def _score_products(softmax: torch.fx.Node, dependent: set[torch.fx.Node]) -> list[torch.fx.Node]:
    """The products the softmax's logits come from through elementwise and shape ops, following token-dependent
    values only (the bias is positional; a baddbmm's bias term is followed too). Empty when the logits are made
    otherwise (e.g. a router's linear: not attention); an attention whose logits also depend on the tokens
    through another op is refused, naming it."""
    found, foreign, stack, seen = [], [], [softmax.args[0]], set()
    while stack:
        node = stack.pop()
        if node in seen or node not in dependent:
            continue
        seen.add(node)
        if node.target in SCORES:
            found.append(node)
            stack.extend(node.args[:1] if node.target is aten.baddbmm.default else [])
        elif node.target in _ELEMENTWISE or node.target in _SHAPES:
            stack.extend(node.all_input_nodes)
        else:
            foreign.append(node)
    if found and foreign:
        raise PassError(
            f"eager_attention: {softmax.name}'s logits depend on the tokens through {foreign[0].name} besides q·kᵀ"
        )
    return found


def _heads_first(node: torch.fx.Node) -> torch.fx.Node | None:
    """The first [batch, heads, tokens, dim] tensor (static heads and dim) found following `node` back through
    shape ops; None if another op comes first."""
    while node.op == "call_function":
        meta = tensor_meta(node)
        if meta is not None and meta.dim() == 4 and isinstance(meta.shape[1], int) and isinstance(meta.shape[3], int):
            return node
        if node.target not in _SHAPES:
            return None
        node = node.args[0]
    return None


def _weighted(softmax: torch.fx.Node) -> torch.fx.Node | None:
    """The matmul of the softmax's weights (after casts, views and eval-mode dropout) with the values."""
    node = softmax
    while len(node.users) == 1:
        user = next(iter(node.users))
        if user.target in WEIGHTED and user.args[0] is node:
            return user
        if user.target not in _WEIGHTS_PATH:
            return None
        node = user
    return None


def _site(softmax: torch.fx.Node, dependent: set[torch.fx.Node]) -> Site | None:
    """The site of an attention softmax; None for a softmax whose logits are no product (not attention)."""
    products = _score_products(softmax, dependent)
    if not products:
        return None
    if len(products) != 1:
        raise PassError(f"eager_attention: {softmax.name}'s logits come from {len(products)} products, not one q·kᵀ")
    scores = products[0]
    if softmax.args[1] not in (-1, tensor_meta(softmax).dim() - 1):
        raise PassError(f"eager_attention: {softmax.name} normalises over dim {softmax.args[1]}, not the keys")
    weighted = _weighted(softmax)
    if weighted is None:
        raise PassError(f"eager_attention: {softmax.name}'s weights do not go into one matmul with the values")
    out = weighted
    if tensor_meta(out).dim() != 4 and len(out.users) == 1 and next(iter(out.users)).target in RESHAPES:
        out = next(iter(out.users))  # [batch * heads, tokens, dv] viewed as [batch, heads, tokens, dv]
    q, k = (_heads_first(x) for x in scores.args[-2:])
    v = _heads_first(weighted.args[1])
    if None in (q, k, v) or tensor_meta(out).dim() != 4:
        raise PassError(f"eager_attention: {softmax.name}: q, k, v or the output have no [batch, heads, tokens, dim]")
    return Site(softmax, scores, q, k, v, out)


class _Recorder(torch.fx.Interpreter):
    """Runs the graph and keeps every node's value."""

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        super().__init__(gm, garbage_collect_values=False)

    def values(self, *args: torch.Tensor) -> dict[torch.fx.Node, Any]:
        with torch.no_grad():
            self.run(*args)
        return self.env


def _logits(site: Site, region: list[torch.fx.Node], values: dict[torch.fx.Node, Any], p: float) -> torch.Tensor:
    """The softmax's input with q·kᵀ replaced by the constant p (baddbmm keeps its bias term)."""
    scores = site.scores
    product = torch.full_like(values[scores], p)
    if scores.target is aten.baddbmm.default:
        product = scores.kwargs.get("beta", 1) * values[scores.args[0]] + scores.kwargs.get("alpha", 1) * product
    local = {scores: product}
    for node in region:
        if any(i in local for i in node.all_input_nodes):
            args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: local.get(n, values.get(n)))
            local[node] = node.target(*args, **kwargs)
    return local[site.softmax.args[0]]


def _transform(name: str, curve: dict[float, torch.Tensor], tolerance: float) -> tuple[float, float]:
    """(scale, softcap) of f from f(p) at the probes (each a tensor over the visible logits, float64): linear, or
    fitted where softcap * tanh(scale * p / softcap) has bent (f(2p) / f(p) = 2 / (1 + tanh²), below BENT)."""
    means = {p: float(y.mean()) for p, y in curve.items()}
    bent = next((p for p in list(curve)[:-1] if means[p] and means[2 * p] / means[p] < BENT), None)
    scale, softcap = means[1.0], 0.0
    if bent is not None and 0 < (t := math.sqrt(max(2 * means[bent] / means[2 * bent] - 1, 0))) < 1:
        softcap = means[bent] / t
        scale = softcap * math.atanh(t) / bent
    for p, y in curve.items():
        expected = softcap * math.tanh(scale * p / softcap) if softcap else scale * p
        if float((y - expected).abs().max()) > tolerance * (1 + abs(expected)):
            raise PassError(
                f"eager_attention: {name}'s logits are not q·kᵀ scaled (and soft-capped) plus a bias: "
                f"{float(y.mean()):.6g} at q·kᵀ = {p:g}, expected {expected:.6g}"
            )
    return scale, softcap


def _slopes(name: str, bias: torch.Tensor, visible_keys: torch.Tensor, tolerance: float) -> torch.Tensor | None:
    """ALiBi's slopes [heads] of a bias [batch, heads, tokens, keys] that is slope_h * key + a constant per row
    where visible; None when every slope is 0."""
    keys = torch.arange(bias.shape[-1], dtype=torch.float64)
    last = bias.shape[-2] - 1
    first = int(visible_keys[last].nonzero()[0])
    span = max(last - first, 1)
    slopes = (bias[0, :, last, last] - bias[0, :, last, first]) / span  # [heads]
    residual = (bias - slopes[None, :, None, None] * keys).masked_fill(~visible_keys, 0)
    rows = residual.sum(-1, keepdim=True) / visible_keys.sum(-1, keepdim=True)
    error = (residual - rows).masked_fill(~visible_keys, 0).abs().max()
    if float(error) > tolerance * (1 + float(bias.masked_fill(~visible_keys, 0).abs().max())):
        raise PassError(f"eager_attention: {name}'s bias is not linear in the key position (ALiBi): off by {error:.3g}")
    if float(slopes.abs().max()) <= tolerance:
        return None
    return slopes.float()


def _parameters(site: Site, region: list[torch.fx.Node], values: dict, window: int) -> dict[str, Any]:
    """causal_attention's scale, softcap and alibi_slopes for the site, each measured and then checked."""
    name = site.softmax.name
    batch, heads, tokens = values[site.q].shape[:3]
    dtype = values[site.softmax.args[0]].dtype
    tolerance = max(1e-4, 16 * torch.finfo(dtype).eps)
    bias = _logits(site, region, values, 0.0)
    hidden = torch.finfo(bias.dtype).min * MASKED
    bias = bias.double()
    if bias.numel() != batch * heads * tokens * tokens:
        raise PassError(f"eager_attention: {name}'s logits {tuple(bias.shape)} are not one per query and key")
    bias = bias.reshape(batch, heads, tokens, tokens)
    shown = bias > hidden
    positions = torch.arange(tokens)
    causal = visible(positions[None, :], positions[:, None], window)
    if not torch.equal(shown, causal.expand_as(shown)):
        raise PassError(
            f"eager_attention: {name}'s mask is not causal attention's (window {window}): "
            f"{int((shown != causal).sum())} of {shown.numel()} logits differ"
        )
    probes = [p for p in PROBES if p * p <= torch.finfo(dtype).max]  # logits well within the dtype's range
    curve = {p: (_logits(site, region, values, p).double().reshape(bias.shape) - bias)[shown] for p in probes}
    scale, softcap = _transform(name, curve, tolerance)
    return {"scale": scale, "softcap": softcap, "alibi_slopes": _slopes(name, bias, causal, tolerance)}


def _check_output(site: Site, values: dict, window: int, found: dict[str, Any]) -> None:
    """The site's recorded output equals causal_attention's with the parameters found."""
    q, k, v = (values[x] for x in (site.q, site.k, site.v))
    positions = torch.arange(q.shape[2])
    allowed = visible(positions[None, :], positions[:, None], window)
    bias = alibi_bias(found["alibi_slopes"], positions[None, :], positions[:, None])
    expected = attend(q, k, v, allowed, found["scale"], found["softcap"], None, bias)
    recorded = values[site.out]
    tolerance = max(1e-4, 16 * torch.finfo(recorded.dtype).eps)
    if not torch.allclose(recorded.float(), expected.float(), rtol=tolerance, atol=tolerance):
        error = float((recorded.float() - expected.float()).abs().max())
        raise PassError(f"eager_attention: {site.softmax.name} does not compute causal attention (off by {error:.3g})")


def eager_attention(program: Program) -> tuple[Program, dict[str, Any]]:
    if program.has_kv_cache:
        raise PassError("eager_attention: run it before kv_cache")
    gm = program.graph_module
    graph = gm.graph
    dependent = _token_dependent(graph)
    sites = [s for n in graph.nodes if n.target in SOFTMAX and (s := _site(n, dependent)) is not None]
    if not sites:
        return program, {"matches": 0}
    inputs = example_inputs(program, BATCH, TOKENS, context=1)
    values = _Recorder(gm).values(*(inputs[t.name] for t in program.inputs))
    nodes = list(graph.nodes)
    slope_buffers: list[tuple[torch.Tensor, str]] = []  # each distinct set of slopes stored once
    alibi = 0
    for layer, site in enumerate(sites):
        window = program.spec.window_for_layer(layer)
        region = nodes[nodes.index(site.scores) + 1 : nodes.index(site.softmax)]
        found = _parameters(site, region, values, window)
        _check_output(site, values, window, found)
        slopes = found["alibi_slopes"]
        with graph.inserting_before(site.out):
            if slopes is not None:
                same = [name for stored, name in slope_buffers if torch.equal(stored, slopes)]
                if not same:
                    same = [f"alibi_slopes_{len(slope_buffers)}"]
                    gm.register_buffer(same[0], slopes)
                    slope_buffers.append((slopes, same[0]))
                slopes = graph.get_attr(same[0])
                alibi += 1
            call = graph.call_function(
                CAUSAL_ATTENTION.overload,
                (site.q, site.k, site.v, found["scale"], window, found["softcap"], None, slopes),
            )
        replace_uses([site.out], [call])
    finish(gm)
    return replace(program, fresh_meta=False), {"matches": len(sites), "alibi": alibi}


register_pass(
    Pass(
        name="eager_attention",
        summary="attention written out (q·kᵀ, softmax, ·v; ALiBi, masks) -> causal_attention",
        explain=(
            "Finds each softmax over the keys whose logits come from one bmm / matmul / baddbmm of q and kᵀ and "
            "whose weights go into one matmul with v (Bloom; any model run with transformers' eager attention), "
            "and replaces it with llmlower::causal_attention. Scale and soft-capping are measured on a recorded "
            "run by replacing q·kᵀ with constants; the bias must be the causal mask (the config's window) plus "
            "slope_h * key position (ALiBi, whose slopes become a constant), independent of the tokens; the "
            "output is then checked against causal_attention's. Anything else is refused naming the softmax. "
            "Models with SDPA or llmlower's attention capture have no such site: the program is unchanged."
        ),
        run=eager_attention,
        tolerance=1e-4,
    )
)
