"""canonicalize: drop export noise (asserts, identity ops), complex values as real pairs, fold constants, remove
dead code."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
import torch.fx

from ..ir.program import ASSERT_TARGETS, Program, fetch_attr
from .complex_pairs import lower_complex
from .graph_utils import RESHAPES, finish, tensor_meta
from .registry import Pass, register_pass

aten = torch.ops.aten

_ALWAYS_IDENTITY = {aten.alias.default, aten.detach.default, aten.lift_fresh_copy.default}
_CASTS = {aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten._to_copy.default, aten.type_as.default}
_NEUTRAL_SCALAR = {aten.mul.Tensor: 1, aten.div.Tensor: 1, aten.add.Tensor: 0, aten.sub.Tensor: 0}


def _round_trip_reshapes(gm: torch.fx.GraphModule) -> int:
    """A reshape of a reshape back to the first one's input shape is that input: the same values, and no symbolic
    guard that torch cannot prove when re-exporting (Llama 4's experts flatten [experts, tokens, hidden] to rows and
    split them back)."""
    removed = 0
    for node in list(gm.graph.nodes):
        inner = node.args[0] if node.op == "call_function" and node.target in RESHAPES else None
        if not (isinstance(inner, torch.fx.Node) and inner.target in RESHAPES):
            continue
        source, result = tensor_meta(inner.args[0]), tensor_meta(node)
        if source is not None and result is not None and str(source.shape) == str(result.shape):
            node.replace_all_uses_with(inner.args[0])
            removed += 1
    return removed


def _is_identity(node: torch.fx.Node) -> bool:
    """True when the node returns its first input unchanged (same values, dtype, shape and device)."""
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], torch.fx.Node):
        return False
    if node.target in _ALWAYS_IDENTITY:
        return True
    if node.target is aten.dropout.default:  # (x, p, train): inference graphs carry train=False
        return node.args[1] == 0 or not node.args[2]
    source, result = tensor_meta(node.args[0]), tensor_meta(node)
    if source is None or result is None:
        return False
    same = source.dtype == result.dtype and source.device == result.device and source.shape == result.shape
    if node.target in _CASTS:
        return same
    neutral = _NEUTRAL_SCALAR.get(node.target)
    other = node.args[1] if len(node.args) > 1 else None
    return neutral is not None and same and not node.kwargs and type(other) in (int, float) and other == neutral


def _fold_constants(gm: torch.fx.GraphModule) -> int:
    """Evaluate every node computed from weights and literals alone; store the frontier results as buffers."""
    values: dict[torch.fx.Node, Any] = {}
    folded = 0
    for node in list(gm.graph.nodes):
        if node.op == "get_attr":
            values[node] = fetch_attr(gm, node.target)
            continue
        inputs = node.all_input_nodes
        if node.op != "call_function" or not all(i in values for i in inputs):
            continue
        if isinstance(node.target, torch._ops.OpOverload) and node.target._schema.is_mutable:
            continue
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: values[n])
        values[node] = node.target(*args, **kwargs)
    for node, value in values.items():
        if node.op == "get_attr" or not isinstance(value, torch.Tensor):
            continue
        if all(user in values for user in node.users):
            continue  # an inner node of a folded expression
        name = f"_folded_{folded}"
        gm.register_buffer(name, value)
        with gm.graph.inserting_before(node):
            constant = gm.graph.get_attr(name)
        node.replace_all_uses_with(constant)
        folded += 1
    return folded


def canonicalize(program: Program) -> tuple[Program, dict[str, Any]]:
    program = program.with_fresh_meta()
    gm = program.graph_module
    asserts = identities = 0
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in ASSERT_TARGETS:
            gm.graph.erase_node(node)
            asserts += 1
        elif _is_identity(node):
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
            identities += 1
    complex_ops = lower_complex(gm)
    identities += _round_trip_reshapes(gm)
    folded = _fold_constants(gm)
    finish(gm)
    stats = {"asserts_removed": asserts, "identities_removed": identities, "constants_folded": folded}
    program = replace(program, fresh_meta=program.fresh_meta and not complex_ops)
    return program, stats | ({"complex_ops_as_real_pairs": complex_ops} if complex_ops else {})


register_pass(
    Pass(
        name="canonicalize",
        summary="drop export asserts and identity ops, fold constants, remove dead code",
        explain=(
            "Removes the checks torch.export leaves in the graph (_assert_tensor_metadata, _assert_scalar, "
            "sym_constrain_range), identity ops (alias, dropout in eval, casts to the same dtype, x*1, "
            "x+0, a reshape back to the shape it came from), rewrites complex tensors as real (real, imaginary) "
            "pairs (no backend has a complex dtype), evaluates every subgraph that depends only on weights and "
            "literals into a constant, and deletes nodes and weights nothing uses. Values are unchanged."
        ),
        run=canonicalize,
    )
)
