"""Per-input-channel scales folded into the op before a group of linears, chosen on calibration tokens: the
machinery of the awq and smoothquant passes.

Linears that read one activation x (the fused q/k/v after a norm, gate/up after one, down after the SwiGLU) get
per-input-channel scales s: their weights are multiplied by s and the op that produced x divides that channel of
its output by s (a norm's weight and bias; the up rows of a gate/up projection or the linear multiplied in), so the
float program computes the same thing while the quantized one rounds differently. A `Method` says which groups it
takes (by the schemes quantize_weights, the next pass given the same options, will give them), the scale for an
exponent alpha, and how the kernel sees the activation; alpha is searched per group (0 to 1; 0 leaves it as it is)
for the smallest error of the quantized group's outputs on calibration tokens. Groups whose activation comes from
anything else and the LM head are left as they are; so is o_proj, whose input could take 1/s only through the v
rows of q/k/v, which would change what the KV cache holds (and gained SmolLM2 0.4% perplexity with awq).
"""

from __future__ import annotations

import operator
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.fx

from ..ir.norms import ADD_RMS_NORM, RMS_NORM
from ..ir.program import LOGITS, Program, fetch_attr
from ..ir.quant import QuantScheme, dequantize, quantize
from ..ir.silu_mul import SILU_MUL
from .calibration_store import remembered
from .graph_utils import RESHAPES, finish, lm_head, output_node_for
from .kv_cache_dtype import calibration_inputs
from .patterns import is_constant
from .quantize_weights import QuantPlan, as_linear

aten = torch.ops.aten

ALPHAS = tuple(i / 20 for i in range(21))
SEARCH_TOKENS = 256  # calibration rows each group's search scores (evenly spaced over the text)


class Method(Protocol):
    """Which groups a scaling pass takes and how it scales them."""

    def takes(self, schemes: list[QuantScheme]) -> bool:
        """Whether a group whose linears get these schemes is scaled."""
        ...

    def scales(self, rows: torch.Tensor, weights: list[torch.Tensor], alpha: float) -> torch.Tensor:
        """The per-input-channel scale for exponent alpha, from the activation's calibration rows [tokens, in]
        and the group's float weights [out, in]."""
        ...

    def seen(self, rows: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
        """The activation rows as the kernel for a weight of `scheme` multiplies them."""
        ...


@dataclass
class Group:
    """Linears reading one activation, how to fold 1/s into its producer, and the activation's calibration rows."""

    activation: torch.fx.Node
    linears: list[torch.fx.Node]
    fold: Callable[[torch.Tensor], None]
    rows: torch.Tensor | None = None


class _Constants:
    """Constant tensors of a graph that a pass may rewrite: read once, by one node, under one name."""

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        self.gm = gm
        tensors = list(gm.named_parameters(remove_duplicate=False)) + list(gm.named_buffers(remove_duplicate=False))
        self.aliases = Counter(t.data_ptr() for _, t in tensors)
        self.reads = Counter(n.target for n in gm.graph.nodes if n.op == "get_attr")

    def owned(self, node: Any) -> bool:
        if not is_constant(node) or len(node.users) != 1 or self.reads[node.target] != 1:
            return False
        return self.aliases[fetch_attr(self.gm, node.target).data_ptr()] == 1

    def get(self, node: torch.fx.Node) -> torch.Tensor:
        return fetch_attr(self.gm, node.target)

    def set(self, node: torch.fx.Node, value: torch.Tensor) -> None:
        owner, _, leaf = node.target.rpartition(".")
        module = self.gm.get_submodule(owner) if owner else self.gm
        delattr(module, leaf)
        module.register_buffer(leaf, value)


def _scale_rows(constants: _Constants, linear: Any, rows: slice) -> Callable[[torch.Tensor], None] | None:
    """Divides output channels `rows` of a linear (its weight and bias) by s, if it is the only reader of both."""
    matmul = as_linear(linear) if isinstance(linear, torch.fx.Node) else None
    if matmul is None:
        return None
    _, weight, bias, transposed = matmul
    if not constants.owned(weight) or not (bias is None or constants.owned(bias)):
        return None

    def fold(s: torch.Tensor) -> None:
        w = constants.get(weight).clone()
        if transposed:
            w[:, rows] /= s.to(w.dtype)
        else:
            w[rows] /= s.to(w.dtype)[:, None]
        constants.set(weight, w)
        if bias is not None:
            b = constants.get(bias).clone()
            b[rows] /= s.to(b.dtype)
            constants.set(bias, b)

    return fold


def _out_features(constants: _Constants, linear: torch.fx.Node) -> int:
    """A linear's output channels (its weight's rows; columns when transposed, as Conv1D stores it)."""
    _, weight, _, transposed = as_linear(linear)
    return constants.get(weight).shape[1 if transposed else 0]


def _last_dim_slice(node: Any) -> tuple[torch.fx.Node, int, int] | None:
    """(source, start, end) of a slice of the last dim with constant bounds."""
    if not isinstance(node, torch.fx.Node) or node.target is not aten.slice.Tensor or len(node.args) < 4:
        return None
    source, dim, start, end = node.args[:4]
    last = {-1} | ({source.meta["val"].dim() - 1} if "val" in source.meta else set())
    if dim not in last or not isinstance(start, int) or not isinstance(end, int):
        return None
    return source, start, end


def _scale_factor(constants: _Constants, factor: Any) -> Callable[[torch.Tensor], None] | None:
    """Divides a multiplication's factor by s: a linear read by nothing else, or the only slice of a linear's
    output channels that reads them (gate and up as two slices of one projection)."""
    if isinstance(factor, torch.fx.Node) and as_linear(factor) is not None and len(factor.users) == 1:
        return _scale_rows(constants, factor, slice(None))
    piece = _last_dim_slice(factor)
    if piece is None or as_linear(piece[0]) is None:
        return None
    source, start, end = piece
    for user in source.users:
        other = _last_dim_slice(user)
        if user is not factor and (other is None or (other[1] < end and start < other[2])):
            return None
    return _scale_rows(constants, source, slice(start, min(end, _out_features(constants, source))))


def _scale_vectors(constants: _Constants, *vectors: Any) -> Callable[[torch.Tensor], None] | None:
    """Divides per-channel constants (a norm's weight, its bias when it has one) by s."""
    present = [v for v in vectors if v is not None]
    if not present or not all(constants.owned(v) for v in present):
        return None

    def fold(s: torch.Tensor) -> None:
        for vector in present:
            value = constants.get(vector)
            constants.set(vector, value / s.to(value.dtype))

    return fold


def _folder(constants: _Constants, node: torch.fx.Node) -> Callable[[torch.Tensor], None] | None:
    """How to divide the channels of `node`'s output by s without changing anything else, or None."""
    if node.op != "call_function":
        return None
    if node.target in RESHAPES:  # a view keeping the channels last (GPT-2's [-1, hidden] before addmm)
        source = node.args[0]
        shapes = [n.meta["val"].shape if "val" in n.meta else None for n in (node, source)]
        same = None not in shapes and shapes[0][-1] == shapes[1][-1]
        return _folder(constants, source) if same and len(source.users) == 1 else None
    if node.target is RMS_NORM.overload:
        return _scale_vectors(constants, node.args[1])
    if node.target is aten.layer_norm.default:
        weight, bias = (list(node.args[2:4]) + [None, None])[:2]
        return _scale_vectors(constants, weight, bias) if weight is not None else None
    if node.target is operator.getitem and node.args[1] == 0:  # add_rms_norm's normalized sum (1: the residual)
        source = node.args[0]
        if isinstance(source, torch.fx.Node) and source.target is ADD_RMS_NORM.overload:
            return _scale_vectors(constants, source.args[2])
        return None
    if node.target is SILU_MUL.overload:  # silu(gate) * up over [gate | up]: the up rows take 1/s
        gate_up = node.args[0]
        if as_linear(gate_up) is None or len(gate_up.users) != 1:
            return None
        rows = _out_features(constants, gate_up)
        return _scale_rows(constants, gate_up, slice(rows // 2, rows))
    if node.target is aten.mul.Tensor:  # act(gate) * up: up's rows take 1/s
        for factor in node.args:
            fold = _scale_factor(constants, factor)
            if fold is not None:
                return fold
    return None


def _groups(program: Program, plan: QuantPlan, constants: _Constants, method: Method) -> tuple[list[Group], int]:
    """The foldable groups the method takes (those whose producer can take 1/s), and how many it takes could not."""
    gm = program.graph_module
    head = lm_head(gm, output_node_for(gm, program.output_names, LOGITS), {aten.linear.default})
    readers: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for node in gm.graph.nodes:
        matmul = as_linear(node)
        if matmul is None or node is head or plan.scheme_for(matmul[1].target) is None:
            continue
        readers.setdefault(matmul[0], []).append(node)
    groups, unfoldable = [], 0
    for activation, linears in readers.items():
        if not method.takes([plan.scheme_for(as_linear(n)[1].target) for n in linears]):
            continue
        shared = set(activation.users) == set(linears) and all(constants.owned(as_linear(n)[1]) for n in linears)
        fold = _folder(constants, activation) if shared else None
        if fold is None:
            unfoldable += 1
        else:
            groups.append(Group(activation, linears, fold))
    return groups, unfoldable


class _Recorder(torch.fx.Interpreter):
    """Runs the graph and keeps each watched node's output as rows [tokens, channels] (float32)."""

    def __init__(self, gm: torch.fx.GraphModule, watched: dict[torch.fx.Node, Group]) -> None:
        super().__init__(gm)
        self.watched = watched

    def run_node(self, node: torch.fx.Node) -> Any:
        result = super().run_node(node)
        group = self.watched.get(node)
        if group is not None:
            rows = result.detach().reshape(-1, result.shape[-1]).float()
            pick = torch.linspace(0, rows.shape[0] - 1, min(SEARCH_TOKENS, rows.shape[0])).round().long()
            group.rows = rows[pick]
        return result


def _quantized(weight: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """The float32 weight [out, in] as `scheme` rounds it."""
    packed = quantize(weight, scheme)
    return dequantize(packed.qweight, packed.scales, packed.zeros, scheme.bits, packed.in_features)


def _search(
    rows: torch.Tensor, weights: list[tuple[torch.Tensor, QuantScheme]], method: Method
) -> tuple[torch.Tensor, float, float]:
    """(s, error unscaled, error with s): the per-channel scale among ALPHAS' whose quantized outputs, from the
    activations as the kernel sees them, are nearest the float ones (summed squared error over the group)."""
    references = [rows @ w.T for w, _ in weights]
    best: tuple[float, torch.Tensor] | None = None
    first = 0.0
    for alpha in ALPHAS:
        s = method.scales(rows, [w for w, _ in weights], alpha) if alpha else torch.ones(rows.shape[1])
        s = s / (s.max() * s.min()).sqrt()
        scaled = rows / s
        error = sum(
            float((method.seen(scaled, scheme) @ _quantized(w * s, scheme).T - ref).pow(2).sum())
            for (w, scheme), ref in zip(weights, references, strict=True)
        )
        first = error if alpha == 0 else first
        if best is None or error < best[0]:
            best = (error, s)
    return best[1], first, best[0]


def scale_channels(
    program: Program, calibration: Sequence[int], plan: QuantPlan, method: Method, name: str
) -> dict[str, Any]:
    """Scale each group the method takes, in place; the pass's statistics. The scales are kept in the calibration
    store under the pass's `name` (a compile with the same program, plan and tokens reads them back)."""
    calibration = list(calibration)[: program.spec.max_positions]
    gm = program.graph_module
    constants = _Constants(gm)
    groups, unfoldable = _groups(program, plan, constants, method)

    def group_weights(group: Group) -> list[tuple[torch.Tensor, QuantScheme]]:
        """The group's float weights [out, in] and the scheme each will get."""
        weights = []
        for linear in group.linears:
            _, weight, _, transposed = as_linear(linear)
            value = constants.get(weight).float()
            weights.append((value.T if transposed else value, plan.scheme_for(weight.target)))
        return weights

    def search() -> dict[str, torch.Tensor]:
        inputs = calibration_inputs(program, calibration)
        with torch.no_grad():
            _Recorder(gm, {g.activation: g for g in groups}).run(*(inputs[n] for n in program.input_names))
        found, errors = {}, torch.zeros(2, dtype=torch.float64)
        for index, group in enumerate(groups):
            found[str(index)], unscaled, scaled = _search(group.rows, group_weights(group), method)
            errors += torch.tensor([unscaled, scaled], dtype=torch.float64)
            group.rows = None
        return {**found, "error": errors}

    options = {"plan": repr(plan), "method": type(method).__name__, "calibration": calibration}
    found, cached = remembered(name, program, options, search)
    for index, group in enumerate(groups):
        s = found[str(index)]
        for linear, (value, _) in zip(group.linears, group_weights(group), strict=True):
            _, weight, _, transposed = as_linear(linear)
            dtype = constants.get(weight).dtype
            constants.set(weight, ((value * s).T if transposed else value * s).to(dtype))
        group.fold(s)
    finish(gm)
    before, after = (float(value) for value in found["error"])
    return {
        "groups_scaled": len(groups),
        "groups_unfoldable": unfoldable,
        "calibration_tokens": len(calibration),
        "calibration_cached": cached,
        "output_error_ratio": round(after / before, 4) if before else 1.0,
    }
