"""quantize_weights: weight-only int8 (per channel) or int4 (grouped) for linears, optionally embeddings.

Every aten.linear (or Conv1D addmm) with a constant weight becomes `qlinear` over the weight in the
format of ir/quant.py, except the LM head with keep_lm_head, the embedding unless quantize_embedding, and
weights whose name contains one of `keep`. A weight used twice (tied embedding and LM head) is quantized
once and shared.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

from ..errors import PassError
from ..ir.program import LOGITS, Program, fetch_attr
from ..ir.qlinear import QEMBEDDING, QLINEAR
from ..ir.quant import QuantizedWeight, QuantScheme, quantize
from .graph_utils import finish, lm_head, output_node_for
from .registry import Pass, register_pass

aten = torch.ops.aten


class _Store:
    """Quantizes each weight once, registers its tensors beside it, and counts the bytes."""

    def __init__(self, gm: torch.fx.GraphModule, scheme: QuantScheme) -> None:
        self.gm, self.scheme = gm, scheme
        self.done: dict[tuple[int, tuple[int, ...], bool], tuple[QuantizedWeight, list[str | None]]] = {}
        self.bytes_before = self.bytes_after = 0

    def get(self, target: str, transposed: bool = False) -> tuple[QuantizedWeight, list[str | None]]:
        """The quantized form of weight `target` ([out, in]; [in, out] when `transposed`, as Conv1D stores it).
        Keyed by the tensor's memory, so a weight reachable under two names (tied) is quantized once."""
        weight = fetch_attr(self.gm, target)
        key = (weight.data_ptr(), tuple(weight.shape), transposed)
        if key not in self.done:
            packed = quantize(weight.t() if transposed else weight, self.scheme)
            owner, _, leaf = target.rpartition(".")
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


def _as_linear(node: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node, Any, bool] | None:
    """(x, weight, bias, transposed) of a matmul by a constant weight: aten.linear (weight [out, in]) or
    the addmm of GPT-2's Conv1D (weight [in, out])."""
    if node.op != "call_function":
        return None
    if node.target is aten.linear.default and node.args[1].op == "get_attr":
        return node.args[0], node.args[1], node.args[2] if len(node.args) > 2 else None, False
    if node.target is aten.addmm.default and node.args[2].op == "get_attr" and not node.kwargs:
        return node.args[1], node.args[2], node.args[0], True
    return None


def quantize_weights(
    program: Program,
    bits: int = 4,
    group: int = 32,
    symmetric: bool = False,
    keep_lm_head: bool = False,
    quantize_embedding: bool = False,
    keep: tuple[str, ...] | list[str] = (),
) -> tuple[Program, dict[str, Any]]:
    try:
        scheme = QuantScheme(bits, group if bits == 4 else 0, symmetric if bits == 4 else True)
    except ValueError as exc:
        raise PassError(f"quantize_weights: {exc}") from None
    gm = program.graph_module
    graph = gm.graph
    store = _Store(gm, scheme)
    head = lm_head(gm, output_node_for(gm, program.output_names, LOGITS), {aten.linear.default})
    kept = quantized = 0
    for node in list(graph.nodes):
        matmul = _as_linear(node)
        if matmul is None:
            continue
        x, weight, bias, transposed = matmul
        if (node is head and keep_lm_head) or any(k in weight.target for k in keep):
            kept += 1
            continue
        packed, names = store.get(weight.target, transposed)
        qweight, scales, zeros = store.attrs(node, names)
        with graph.inserting_before(node):
            qnode = graph.call_function(QLINEAR.overload, (x, qweight, scales, zeros, bias, bits, packed.in_features))
        qnode.meta.update({k: v for k, v in node.meta.items() if k == "val"})
        node.replace_all_uses_with(qnode)
        quantized += 1
    embeddings = 0
    for node in list(graph.nodes):
        if not quantize_embedding or node.target is not aten.embedding.default or node.args[0].op != "get_attr":
            continue
        packed, names = store.get(node.args[0].target)
        qweight, scales, zeros = store.attrs(node, names)
        with graph.inserting_before(node):
            qnode = graph.call_function(
                QEMBEDDING.overload, (node.args[1], qweight, scales, zeros, bits, packed.in_features)
            )
        qnode.meta.update({k: v for k, v in node.meta.items() if k == "val"})
        node.replace_all_uses_with(qnode)
        embeddings += 1
    finish(gm)
    return program, {
        "scheme": scheme.name,
        "linears_quantized": quantized,
        "linears_kept": kept,
        "embeddings_quantized": embeddings,
        "quantized_weight_bytes_before": store.bytes_before,
        "quantized_weight_bytes_after": store.bytes_after,
    }


def _tolerance(options: dict[str, Any]) -> float:
    """Largest logit change (relative to the largest logit) verification accepts: int8 rounding moves logits
    by well under 5% of their range on the models we test, int4 by well under 40%."""
    return 0.05 if options.get("bits", 4) == 8 else 0.4


register_pass(
    Pass(
        name="quantize_weights",
        summary="weight-only int8 (per channel) / int4 (group 32-128, sym or asym) -> qlinear",
        explain=(
            "Replaces each aten.linear with a constant weight by llmlower::qlinear over int8 per-output-channel "
            "weights (symmetric) or int4 weights in groups along the input dim (symmetric, zero point 8, or "
            "asymmetric with 4-bit zero points), packed in ONNX Runtime MatMulNBits' layout. Options: bits, "
            "group, symmetric, keep_lm_head, quantize_embedding (llmlower::qembedding), keep (weight-name "
            "substrings left in full precision). A tied embedding/LM head weight is quantized once."
        ),
        run=quantize_weights,
        tolerance=_tolerance,
    )
)
