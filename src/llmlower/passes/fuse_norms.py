"""fuse_norms: RMSNorm spelled in aten ops -> `rms_norm`; a residual add feeding it -> `add_rms_norm`."""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx

from ..ir.norms import ADD_RMS_NORM, RMS_NORM
from ..ir.program import Program
from .graph_utils import finish, replace_uses
from .patterns import find, is_constant, last_dim
from .registry import Pass, register_pass

aten = torch.ops.aten


def _normalize(x):
    return aten.mul.Tensor(
        x, aten.rsqrt.default(aten.add.Tensor(aten.mean.dim(aten.pow.Tensor_Scalar(x, 2), [-1], True), 1e-6))
    )


def _weight_first(x, weight):
    return aten.mul.Tensor(weight, _normalize(x))


def _weight_last(x, weight):
    return aten.mul.Tensor(_normalize(x), weight)


def _weight_first_cast(x, weight):  # half-precision models normalise in float32
    return aten.mul.Tensor(weight, aten.to.dtype(_normalize(aten.to.dtype(x, torch.float32)), torch.float16))


def _weight_last_cast(x, weight):
    return aten.mul.Tensor(aten.to.dtype(_normalize(aten.to.dtype(x, torch.float32)), torch.float16), weight)


def _add_then_norm(x, residual, weight):
    total = aten.add.Tensor(x, residual)
    return RMS_NORM.overload(total, weight, 1e-6), total


def _fuse_rms_norms(gm: torch.fx.GraphModule) -> int:
    fused = 0
    for pattern in (_weight_first, _weight_last, _weight_first_cast, _weight_last_cast):
        for match in find(gm, pattern):
            x, weight = match.inputs
            hidden = last_dim(gm, x)
            shape_ok = hidden is not None and last_dim(gm, weight) == hidden
            mean = match.node(aten.mean.dim)
            if not (is_constant(weight) and shape_ok and match.node(aten.pow.Tensor_Scalar).args[1] == 2):
                continue
            if list(mean.args[1]) not in ([-1], [len(x.meta["val"].shape) - 1]) or not mean.args[2]:
                continue
            casts = match.all(aten.to.dtype)
            if casts and (casts[0].args[1] != torch.float32 or casts[1].args[1] != x.meta["val"].dtype):
                continue
            eps = float(match.node(aten.add.Tensor).args[1])
            with gm.graph.inserting_before(match.outputs[0]):
                node = gm.graph.call_function(RMS_NORM.overload, (x, weight, eps))
            replace_uses(match.outputs, [node])
            fused += 1
        gm.graph.eliminate_dead_code()  # the next pattern must not see the replaced nodes
    return fused


def _fuse_residual_adds(gm: torch.fx.GraphModule) -> int:
    fused = 0
    sums: dict[torch.fx.Node, torch.fx.Node] = {}  # a fused add -> the add_rms_norm output now holding it
    for match in find(gm, _add_then_norm):  # matched before any rewrite: inputs may be adds fused since
        x, residual, weight = (sums.get(node, node) for node in match.inputs)
        add = match.node(aten.add.Tensor)
        if add.kwargs or x.meta.get("val") is None or residual.meta.get("val") is None:
            continue
        if x.meta["val"].shape != residual.meta["val"].shape:
            continue  # a broadcasting add is not a residual
        eps = match.node(RMS_NORM.overload).args[2]
        with gm.graph.inserting_before(match.outputs[0]):
            call = gm.graph.call_function(ADD_RMS_NORM.overload, (x, residual, weight, eps))
            normed = gm.graph.call_function(operator.getitem, (call, 0))
            total = gm.graph.call_function(operator.getitem, (call, 1))
        replace_uses(match.outputs, [normed, total])
        sums[add] = total
        fused += 1
    return fused


def fuse_norms(program: Program) -> tuple[Program, dict[str, Any]]:
    program = program.with_fresh_meta()
    gm = program.graph_module
    norms = _fuse_rms_norms(gm)
    with_residual = _fuse_residual_adds(gm)
    finish(gm)
    return program, {"rms_norm": norms - with_residual, "add_rms_norm": with_residual}


register_pass(
    Pass(
        name="fuse_norms",
        summary="RMSNorm -> rms_norm; residual add + RMSNorm -> add_rms_norm",
        explain=(
            "Matches x * rsqrt(mean(x^2, -1, keepdim) + eps) times a constant weight of size hidden (weight "
            "first or last, with or without the float32 casts of half-precision models; Gemma's 1 + w is a "
            "folded constant by then) and replaces it with llmlower::rms_norm(x, w, eps). Then an rms_norm "
            "whose input is a same-shape add becomes llmlower::add_rms_norm(a, b, w, eps) -> (normed, a + b), "
            "the sum feeding the next residual. LayerNorm models (GPT-2) have 0 matches and are unchanged."
        ),
        run=fuse_norms,
    )
)
