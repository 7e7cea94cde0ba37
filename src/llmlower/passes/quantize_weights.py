"""quantize_weights: weight-only int8 or int4 (grouped) for linears and MoE experts, optionally embeddings.

Every aten.linear (or Conv1D addmm) with a constant weight becomes `qlinear` over the weight in the
format of ir/quant.py, and every `moe_experts` over constant weights `qmoe_experts` (each expert quantized as a
linear; gate/up and down named `<experts module>.gate_up_proj` / `.down_proj` for `keep` and `overrides`, the
names transformers' own weights carry), except the LM head with keep_lm_head, the embedding unless
quantize_embedding, and weights whose name contains one of `keep`. The LM head takes int8 (lm_head_bits)
under an int4 scheme by default, as llama.cpp keeps its output layer at higher precision: small models lose
most of their int4 quality there (SmolLM2: perplexity +34% with an int4 head, see the tests). A weight used twice (tied
embedding and LM head) is quantized once and shared.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.fx

from ..errors import PassError
from ..ir.moe import MOE_EXPERTS
from ..ir.program import LOGITS, Program, fetch_attr
from ..ir.qlinear import QEMBEDDING, QLINEAR
from ..ir.qmoe import QMOE_EXPERTS
from ..ir.quant import QuantizedWeight, QuantScheme, quantize
from .graph_utils import finish, lm_head, output_node_for, replace_uses
from .patterns import is_constant
from .registry import Pass, register_pass

aten = torch.ops.aten


WeightKey = tuple[int, tuple[int, ...], bool, QuantScheme]


def weight_key(weight: torch.Tensor, scheme: QuantScheme, transposed: bool = False) -> WeightKey:
    """Names one quantized form of a weight by its memory, so a weight reachable under two names (tied) is one."""
    return weight.data_ptr(), tuple(weight.shape), transposed, scheme


class _Store:
    """Quantizes each weight once per scheme (or takes the form `rounded` holds for it, as gptq chose it),
    registers its tensors beside it, and counts the bytes."""

    def __init__(self, gm: torch.fx.GraphModule, rounded: dict[WeightKey, QuantizedWeight]) -> None:
        self.gm = gm
        self.rounded = rounded
        self.done: dict[WeightKey, tuple[QuantizedWeight, list[str | None]]] = {}
        self.bytes_before = self.bytes_after = 0

    def get(
        self, target: str, scheme: QuantScheme, transposed: bool = False
    ) -> tuple[QuantizedWeight, list[str | None]]:
        """The quantized form of weight `target` ([out, in]; [in, out] when `transposed`, as Conv1D stores it;
        [experts, out, in] for a MoE layer's).
        Keyed by the tensor's memory, so a weight reachable under two names (tied) is quantized once."""
        weight = fetch_attr(self.gm, target)
        key = weight_key(weight, scheme, transposed)
        if key not in self.done:
            packed = self.rounded.get(key) or quantize(weight.t() if transposed else weight, scheme)
            owner, _, leaf = target.rpartition(".")
            leaf = f"{leaf}_{scheme.name}"
            module = self.gm.get_submodule(owner)
            names: list[str | None] = []
            for suffix, tensor in (("qweight", packed.qweight), ("scales", packed.scales), ("zeros", packed.zeros)):
                if tensor is None:
                    names.append(None)
                    continue
                module.register_buffer(f"{leaf}_{suffix}", tensor)
                names.append(f"{owner}.{leaf}_{suffix}" if owner else f"{leaf}_{suffix}")
            self.done[key] = (packed, names)
            self.bytes_before += weight.numel() * weight.element_size()
            self.bytes_after += packed.nbytes()
        return self.done[key]

    def attrs(self, node: torch.fx.Node, names: list[str | None]) -> list[torch.fx.Node | None]:
        with self.gm.graph.inserting_before(node):
            return [self.gm.graph.get_attr(n) if n is not None else None for n in names]


def as_linear(node: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node, Any, bool] | None:
    """(x, weight, bias, transposed) of a matmul by a constant weight: aten.linear (weight [out, in]) or
    the addmm of GPT-2's Conv1D (weight [in, out])."""
    if node.op != "call_function":
        return None
    if node.target is aten.linear.default and node.args[1].op == "get_attr":
        return node.args[0], node.args[1], node.args[2] if len(node.args) > 2 else None, False
    if node.target is aten.addmm.default and node.args[2].op == "get_attr" and not node.kwargs:
        return node.args[1], node.args[2], node.args[0], True
    return None


def _scheme(
    bits: int, group: int = 32, symmetric: bool = False, packed_zeros: bool = False, scale_dtype: str | None = None
) -> QuantScheme:
    """int8 ignores the zero-point options (it is symmetric)."""
    if bits == 8:
        return QuantScheme(bits, group, scale_dtype=scale_dtype)
    return QuantScheme(bits, group, symmetric, packed_zeros, scale_dtype)


def _override(target: str, special: list[tuple[str, QuantScheme]], default: QuantScheme) -> QuantScheme:
    """The scheme of the first override whose name is in the weight's name, else the default."""
    return next((scheme for name, scheme in special if name in target), default)


@dataclass(frozen=True)
class QuantPlan:
    """The scheme each weight gets from quantize_weights' options (read by the passes that prepare for it)."""

    scheme: QuantScheme
    head: QuantScheme | None  # None: the LM head stays float
    special: list[tuple[str, QuantScheme]]
    keep: tuple[str, ...]
    embedding: bool  # the embedding table too (the head's scheme when tied to it)

    @classmethod
    def of(
        cls,
        bits: int = 4,
        group: int = 32,
        symmetric: bool = False,
        packed_zeros: bool = False,
        keep_lm_head: bool = False,
        lm_head_bits: int = 8,
        lm_head_group: int | None = None,
        keep: Sequence[str] = (),
        overrides: Sequence[tuple[str, dict[str, Any]]] = (),
        quantize_embedding: bool = False,
        scale_dtype: str | None = None,
    ) -> QuantPlan:
        """quantize_weights' options (`lm_head_group`: the LM head's group, default the weights'; 0 with int8:
        per channel; `scale_dtype`: every scheme's, overrides' too); raises ValueError or TypeError for options no
        scheme has."""
        head_group = group if lm_head_group is None else lm_head_group
        head = None if keep_lm_head else _scheme(lm_head_bits, head_group, symmetric, packed_zeros, scale_dtype)
        special = [(name, _scheme(**{"scale_dtype": scale_dtype, **options})) for name, options in overrides]
        scheme = _scheme(bits, group, symmetric, packed_zeros, scale_dtype)
        return cls(scheme, head, special, tuple(keep), quantize_embedding)

    def scheme_for(self, target: str) -> QuantScheme | None:
        """A linear's scheme by its weight's name (not the LM head's); None where `keep` leaves it float."""
        if any(k in target for k in self.keep):
            return None
        return _override(target, self.special, self.scheme)


def quant_plan(name: str, options: dict[str, Any] | None) -> QuantPlan:
    """The QuantPlan of quantize_weights' options, for the pass `name` that reads them (its name in the errors)."""
    try:
        return QuantPlan.of(**(options or {}))
    except (TypeError, ValueError) as exc:
        raise PassError(f"{name}: {exc}") from None


def _swap(graph: torch.fx.Graph, node: torch.fx.Node, op: Any, args: tuple, kwargs: dict | None = None) -> None:
    with graph.inserting_before(node):
        new = graph.call_function(op, args, kwargs)
    replace_uses([node], [new])


def _experts_path(node: torch.fx.Node, w_down: torch.fx.Node) -> str:
    """The experts module's path (its innermost entry in torch.export's module stack), else its down weight's owner."""
    stack = node.meta.get("nn_module_stack") or {}
    paths = [entry[0] for entry in stack.values() if isinstance(entry, tuple) and entry and entry[0]]
    return paths[-1] if paths else w_down.target.rpartition(".")[0]


def _quantize_experts(
    store: _Store, scheme: QuantScheme, special: list[tuple[str, QuantScheme]], keep: Sequence[str]
) -> tuple[int, int]:
    """moe_experts over constant weights -> qmoe_experts, gate/up and down each with the scheme its name selects;
    both stay float when `keep` names either (qmoe_experts quantizes both). Returns (quantized, kept)."""
    graph = store.gm.graph
    quantized = kept = 0
    for node in list(graph.nodes):
        if node.target is not MOE_EXPERTS.overload or not (is_constant(node.args[3]) and is_constant(node.args[5])):
            continue
        x, ids, weights, w_up, b_up, w_down, b_down, *gate = node.args
        path = _experts_path(node, w_down)
        names = (f"{path}.gate_up_proj", f"{path}.down_proj")
        if any(k in name for k in keep for name in names):
            kept += 1
            continue
        up_scheme, down_scheme = (_override(name, special, scheme) for name in names)
        up = store.attrs(node, store.get(w_up.target, up_scheme)[1])
        down = store.attrs(node, store.get(w_down.target, down_scheme)[1])
        args = (x, ids, weights, *up, b_up, up_scheme.bits, *down, b_down, down_scheme.bits, *gate)
        _swap(graph, node, QMOE_EXPERTS.overload, args, dict(node.kwargs))
        quantized += 1
    return quantized, kept


def linear_schemes(program: Program, plan: QuantPlan) -> dict[torch.fx.Node, QuantScheme | None]:
    """Each linear of the program and the scheme the plan gives it (the LM head the head's; None: kept float)."""
    gm = program.graph_module
    head = lm_head(gm, output_node_for(gm, program.output_names, LOGITS), {aten.linear.default})
    schemes = {}
    for node in gm.graph.nodes:
        matmul = as_linear(node)
        if matmul is not None:
            scheme = plan.scheme_for(matmul[1].target)
            schemes[node] = plan.head if node is head and scheme is not None else scheme
    return schemes


def quantize_weights(program: Program, **options: Any) -> tuple[Program, dict[str, Any]]:
    """`options`: QuantPlan.of's (bits, group, symmetric, packed_zeros, keep_lm_head, lm_head_bits, keep,
    overrides, quantize_embedding, scale_dtype)."""
    return program, replace_weights(program, quant_plan("quantize_weights", options))


def replace_weights(
    program: Program, plan: QuantPlan, rounded: dict[WeightKey, QuantizedWeight] | None = None
) -> dict[str, Any]:
    """Quantize the program's weights by the plan, in place (those in `rounded` as given there); the statistics."""
    scheme, special = plan.scheme, plan.special
    gm = program.graph_module
    graph = gm.graph
    store = _Store(gm, rounded or {})
    head = lm_head(gm, output_node_for(gm, program.output_names, LOGITS), {aten.linear.default})
    head_weight = fetch_attr(gm, head.args[1].target) if head is not None and is_constant(head.args[1]) else None
    kept = quantized = embeddings = 0
    for node, node_scheme in linear_schemes(program, plan).items():
        x, weight, bias, transposed = as_linear(node)
        if node_scheme is None:
            kept += 1
            continue
        packed, names = store.get(weight.target, node_scheme, transposed)
        qweight, scales, zeros = store.attrs(node, names)
        _swap(graph, node, QLINEAR.overload, (x, qweight, scales, zeros, bias, node_scheme.bits, packed.in_features))
        quantized += 1
    experts, experts_kept = _quantize_experts(store, scheme, special, plan.keep)
    for node in list(graph.nodes):
        if not plan.embedding or node.target is not aten.embedding.default or not is_constant(node.args[0]):
            continue
        table = fetch_attr(gm, node.args[0].target)
        tied = head_weight is not None and plan.head is not None and table.data_ptr() == head_weight.data_ptr()
        # a table tied to the head shares its quantized form, unless the head's scales are narrower than the
        # table's dtype: qembedding returns rows in its scales' dtype (a lookup reads one row: nothing to save)
        node_scheme = replace(plan.head if tied else scheme, scale_dtype=None)
        packed, names = store.get(node.args[0].target, node_scheme)
        qweight, scales, zeros = store.attrs(node, names)
        _swap(
            graph,
            node,
            QEMBEDDING.overload,
            (node.args[1], qweight, scales, zeros, node_scheme.bits, packed.in_features),
        )
        embeddings += 1
    finish(gm)
    return {
        "scheme": scheme.name,
        "overrides": {name: override.name for name, override in special},
        "lm_head": "kept" if plan.head is None else plan.head.name,
        "linears_quantized": quantized,
        "linears_kept": kept,
        "experts_quantized": experts,
        "experts_kept": experts_kept,
        "embeddings_quantized": embeddings,
        "quantized_weight_bytes_before": store.bytes_before,
        "quantized_weight_bytes_after": store.bytes_after,
    }


def quantized_tolerance(options: dict[str, Any]) -> float:
    """Largest logit change (relative to the largest logit) verification accepts: int8 rounding moves logits
    by well under 5% of their range on the models we test, int4 (any weight of it) by well under 40%."""
    int4 = options.get("bits", 4) == 4 or any(o.get("bits") == 4 for _, o in options.get("overrides", ()))
    return 0.4 if int4 else 0.05


register_pass(
    Pass(
        name="quantize_weights",
        summary="weight-only int8 (sym, grouped or per channel) / int4 (sym or asym) -> qlinear, qmoe_experts",
        explain=(
            "Replaces each aten.linear with a constant weight by llmlower::qlinear over int8 weights (symmetric) "
            "or int4 weights in groups along the input dim (symmetric, zero point 8, or "
            "asymmetric with float zero points, or with packed 4-bit ones), in ONNX Runtime MatMulNBits' "
            "layout, and each llmlower::moe_experts by llmlower::qmoe_experts over its experts quantized alike "
            "(named <experts module>.gate_up_proj and .down_proj for keep and overrides). "
            "Options: bits, group (int8: 0 is per channel), symmetric, packed_zeros, lm_head_bits (8 by default: "
            "the LM head in int8 under int4), lm_head_group (default: group), keep_lm_head, "
            "quantize_embedding (llmlower::qembedding, its scales in the table's dtype), scale_dtype (float16: "
            "scales and float zero points in 16 bits, as llama.cpp keeps them; default the weights' dtype), "
            "keep (weight-name substrings left in full precision), "
            "overrides ([name substring, {bits, group, symmetric, packed_zeros}] pairs: the first whose name is in "
            "a linear's weight name sets its scheme; not the LM head's). "
            "A tied embedding/LM head weight is quantized once."
        ),
        run=quantize_weights,
        tolerance=quantized_tolerance,
    )
)
