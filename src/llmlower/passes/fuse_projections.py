"""fuse_projections: linears that read the same activation become one matmul over concatenated weights
(q/k/v, gate/up); a fused gate/up feeding silu(gate) * up becomes `silu_mul`."""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

import torch
import torch.fx

from ..ir.program import Program, fetch_attr
from ..ir.silu_mul import SILU_MUL
from .graph_utils import finish, replace_uses
from .lora import adapter_path, lora_sum
from .patterns import is_constant
from .registry import Pass, register_pass

aten = torch.ops.aten
LINEAR = aten.linear.default


def _bias(node: torch.fx.Node) -> torch.fx.Node | None:
    return node.args[2] if len(node.args) > 2 else None


def _sole_user(node: torch.fx.Node) -> torch.fx.Node | None:
    return next(iter(node.users)) if len(node.users) == 1 else None


def _swiglu_roles(
    first: torch.fx.Node, second: torch.fx.Node
) -> tuple[torch.fx.Node, torch.fx.Node, torch.fx.Node] | None:
    """(gate, up, mul) when the two linears feed mul(silu(gate), up), in either order."""
    for gate, up in ((first, second), (second, first)):
        silu = _sole_user(gate)
        if silu is None or silu.target is not aten.silu.default:
            continue
        mul = _sole_user(silu)
        if mul is not None and mul.target is aten.mul.Tensor and set(mul.args) == {silu, up} and _sole_user(up) is mul:
            return gate, up, mul
    return None


def _register(gm: torch.fx.GraphModule, targets: list[str], suffix: str, value: torch.Tensor) -> str:
    """Store a fused tensor beside the originals: layers.0.mlp.{gate_proj,up_proj}.weight ->
    layers.0.mlp.gate_proj_up_proj_weight, so per-layer names (and --keep filters) still apply."""
    modules = [t.rsplit(".", 1)[0] for t in targets]
    owner = os.path.commonprefix([m.split(".") for m in modules])
    leaves = ["_".join(m.split(".")[len(owner) :]) for m in modules]
    name = "_".join(leaves) + f"_{suffix}"
    gm.get_submodule(".".join(owner)).register_buffer(name, value)
    return ".".join([*owner, name])


def _fuse_group(gm: torch.fx.GraphModule, linears: list[torch.fx.Node]) -> bool:
    """Replace `linears` (same input) by one; True when the result feeds a SwiGLU (now silu_mul). Linears with LoRA
    adapter slots (the lora pass) fuse with their adapters' outputs concatenated and added to the fused one."""
    graph = gm.graph
    sums = {n: lora_sum(n) for n in linears}
    outputs = {n: sums[n] or n for n in linears}  # what the linear's users read
    roles = _swiglu_roles(*outputs.values()) if len(linears) == 2 else None
    if roles is not None:  # gate first: silu_mul reads [gate | up]
        linears = [next(n for n in linears if outputs[n] is role) for role in roles[:2]]
    weights = [fetch_attr(gm, n.args[1].target) for n in linears]
    first = min(linears, key=lambda n: list(graph.nodes).index(n))
    with graph.inserting_before(first):
        weight_name = _register(gm, [n.args[1].target for n in linears], "weight", torch.cat(weights))
        args = [linears[0].args[0], graph.get_attr(weight_name)]
        if _bias(linears[0]) is not None:
            biases = torch.cat([fetch_attr(gm, n.args[2].target) for n in linears])
            args.append(graph.get_attr(_register(gm, [n.args[2].target for n in linears], "bias", biases)))
        fused = graph.call_function(LINEAR, tuple(args))
    if all(sums.values()):  # the adapters' outputs, computed before the fused linear, beside it
        deltas = [sums[n].args[1] for n in linears]
        for delta in deltas:
            for node in adapter_path(delta):
                first.prepend(node)
        with graph.inserting_before(first):
            fused = graph.call_function(aten.add.Tensor, (fused, graph.call_function(aten.cat.default, (deltas, -1))))
    if roles is not None:
        mul = roles[2]
        with graph.inserting_before(mul):
            swiglu = graph.call_function(SILU_MUL.overload, (fused,))
        replace_uses([mul], [swiglu])
        return True
    start = 0
    for node, weight in zip(linears, weights, strict=True):
        with graph.inserting_before(outputs[node]):
            piece = graph.call_function(aten.slice.Tensor, (fused, -1, start, start + weight.shape[0]))
        replace_uses([outputs[node]], [piece])
        start += weight.shape[0]
    return False


def fuse_projections(program: Program) -> tuple[Program, dict[str, Any]]:
    gm = program.graph_module
    groups: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for node in gm.graph.nodes:
        bias = _bias(node) if node.op == "call_function" else None
        if node.target is LINEAR and is_constant(node.args[1]) and (bias is None or is_constant(bias)):
            groups.setdefault(node.args[0], []).append(node)
    sizes: Counter[int] = Counter()
    swiglu = 0
    for linears in groups.values():
        weights = [fetch_attr(gm, n.args[1].target) for n in linears]
        same_bias = len({_bias(n) is None for n in linears}) == 1
        same_shape = len({(w.shape[1], w.dtype) for w in weights}) == 1
        same_slots = len({lora_sum(n) is None for n in linears}) == 1  # all with adapter slots or none
        if len(linears) < 2 or not same_bias or not same_shape or not same_slots:
            continue
        swiglu += _fuse_group(gm, linears)
        sizes[len(linears)] += 1
    finish(gm)
    return program, {
        "qkv": sizes[3],
        "pairs": sizes[2],
        "silu_mul": swiglu,
        "other": sum(sizes.values()) - sizes[3] - sizes[2],
    }


register_pass(
    Pass(
        name="fuse_projections",
        summary="q/k/v and gate/up linears of one input -> one matmul; SwiGLU -> silu_mul",
        explain=(
            "Groups aten.linear nodes that read the same activation with constant weights of the same input "
            "width (and all or none with bias), concatenates their weights once at compile time, and computes "
            "one linear whose output is sliced back into the originals (q/k/v: 'qkv' in the stats). When a pair "
            "feeds silu(gate) * up, the product becomes llmlower::silu_mul over [gate | up] ('silu_mul'). "
            "Models whose projections are already fused (GPT-2's c_attn) have nothing to group."
        ),
        run=fuse_projections,
    )
)
