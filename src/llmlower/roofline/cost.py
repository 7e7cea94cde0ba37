"""FLOPs and bytes of every node of a Program for one step: the op set's cost formulas (ir/) for its ops,
shape-derived formulas for aten ops (matmuls, elementwise, reductions, gathers, copies; views are free)."""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from ..ir import OPS, Cost, op_of
from ..ir.program import LOGITS, Program
from ..passes.graph_utils import lm_head, output_node_for
from .shapes import Step, decode_step, propagate

aten = torch.ops.aten
KINDS = ("matmul", "attention", "recurrent", "norm", "elementwise", "embedding", "lm_head")

# Ops that only reinterpret memory (or shapes): no FLOPs, no bytes.
FREE = {
    operator.getitem,
    aten.view.default,
    aten.reshape.default,
    aten._unsafe_view.default,
    aten.transpose.int,
    aten.permute.default,
    aten.t.default,
    aten.unsqueeze.default,
    aten.squeeze.dim,
    aten.squeeze.default,
    aten.expand.default,
    aten.slice.Tensor,
    aten.select.int,
    aten.alias.default,
    aten.detach.default,
    aten.sym_size.int,
}
CASTS = {aten.to.dtype, aten._to_copy.default, aten.to.dtype_layout}
GATHERS = {aten.gather.default, aten.index_select.default, aten.index.Tensor}
REDUCTIONS = {aten.mean.dim, aten.sum.dim_IntList, aten.amax.default, aten.max.dim, aten.var.correction}
MATMULS = {aten.linear.default, aten.mm.default, aten.addmm.default, aten.bmm.default, aten.matmul.default}


@dataclass(frozen=True)
class NodeCost:
    """One node's work in a step, with the kind of op it counts as."""

    name: str
    op: str
    kind: str
    cost: Cost


@dataclass(frozen=True)
class StepCost:
    """Every costed node of a program for one step."""

    step: Step
    nodes: list[NodeCost]

    @property
    def total(self) -> Cost:
        return sum((n.cost for n in self.nodes), Cost(0, 0))

    def by_kind(self) -> dict[str, Cost]:
        """Total cost per op kind, every kind of KINDS present (zero when none)."""
        totals = {kind: Cost(0, 0) for kind in KINDS}
        for n in self.nodes:
            totals[n.kind] = totals[n.kind] + n.cost
        return totals


def nbytes(value: Any) -> int:
    return value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0


def _rows(x: torch.Tensor) -> int:
    return x.numel() // x.shape[-1]


def _extras(args: list[Any], softcap_at: int, v_cache: torch.Tensor) -> dict[str, Any]:
    """The attention cost's value head size (the value cache's), whether the logits are soft-capped and whether
    they carry ALiBi (alibi_slopes: two arguments after softcap)."""
    softcap = len(args) > softcap_at and bool(args[softcap_at])
    alibi = len(args) > softcap_at + 2 and args[softcap_at + 2] is not None
    return dict(value_head_dim=v_cache.shape[-1], softcap=softcap, alibi=alibi)


def _attention(args: list[Any]) -> dict[str, int]:
    q, k_cache = args[0], args[3]
    batch, heads, tokens, head_dim = q.shape
    shape = dict(batch=batch, tokens=tokens, heads=heads, kv_heads=k_cache.shape[1], head_dim=head_dim)
    return shape | _extras(args, 9, args[4])


def _qkv_attention(args: list[Any]) -> dict[str, int]:
    qkv, k_cache = args[0], args[1]
    shape = dict(batch=qkv.shape[0], tokens=qkv.shape[1], heads=args[7], kv_heads=args[8], head_dim=k_cache.shape[-1])
    return shape | _extras(args, 11, args[2])


def _latent_attention(args: list[Any]) -> dict[str, int]:
    q, latent, k_pe, kv_weight, c_cache = args[:5]
    batch, heads, tokens, query_dim = q.shape
    rope_dim = k_pe.shape[-1]
    nope_dim = query_dim - rope_dim
    return dict(
        batch=batch,
        tokens=tokens,
        heads=heads,
        rank=latent.shape[-1],
        rope_dim=rope_dim,
        nope_dim=nope_dim,
        value_head_dim=kv_weight.shape[0] // heads - nope_dim,
        context=c_cache.shape[2],
        element_bytes=q.element_size(),
    )


def _cache_extent(activations: Any, k_cache: Any) -> dict[str, int]:
    """An attention's context and element sizes: its activations', and its cache's (int8: kv_cache_dtype)."""
    return dict(
        context=k_cache.shape[2], element_bytes=activations.element_size(), cache_element_bytes=k_cache.element_size()
    )


def _delta_extent(args: list[Any]) -> dict[str, int]:
    """The delta rule's sizes from q, k, v [batch, tokens, heads, dim]."""
    batch, tokens, heads, dv = args[2].shape
    return dict(
        batch=batch, tokens=tokens, heads=heads, dk=args[1].shape[-1], dv=dv, element_bytes=args[0].element_size()
    )


def _ssd_extent(args: list[Any]) -> dict[str, int]:
    """Mamba-2's scan sizes from x [batch, tokens, heads, head_dim] and B [.., groups, state_size]."""
    batch, tokens, heads, head_dim = args[0].shape
    return dict(
        batch=batch, tokens=tokens, heads=heads, head_dim=head_dim, state_size=args[3].shape[-1],
        element_bytes=args[0].element_size(),
    )  # fmt: skip


def _selective_extent(args: list[Any]) -> dict[str, int]:
    """Mamba's scan sizes from x [batch, channels, tokens] and A [channels, state_size]."""
    batch, channels, tokens = args[0].shape
    return dict(
        batch=batch,
        tokens=tokens,
        channels=channels,
        state_size=args[2].shape[-1],
        element_bytes=args[0].element_size(),
    )


# The llm op set: each op's cost-formula arguments from its call's argument values.
OP_ARGUMENTS: dict[str, Callable[[list[Any]], dict[str, int]]] = {
    "attention": lambda a: {**_attention(a), **_cache_extent(a[0], a[3])},
    "qkv_attention": lambda a: {**_qkv_attention(a), **_cache_extent(a[0], a[1])},
    "latent_attention": _latent_attention,
    "rms_norm": lambda a: dict(rows=_rows(a[0]), hidden=a[0].shape[-1], element_bytes=a[0].element_size()),
    "add_rms_norm": lambda a: dict(rows=_rows(a[0]), hidden=a[0].shape[-1], element_bytes=a[0].element_size()),
    "rope": lambda a: dict(elements=a[0].numel(), element_bytes=a[0].element_size()),
    "silu_mul": lambda a: dict(rows=_rows(a[0]), intermediate=a[0].shape[-1] // 2, element_bytes=a[0].element_size()),
    "qlinear": lambda a: dict(
        rows=_rows(a[0]),
        in_features=a[0].shape[-1],
        out_features=a[1].shape[0],
        weight_bytes=sum(nbytes(t) for t in a[1:5]),
        element_bytes=a[0].element_size(),
    ),
    "moe_experts": lambda a: dict(
        tokens=a[0].shape[0],
        top_k=a[1].shape[1],
        experts=a[3].shape[0],
        hidden=a[0].shape[-1],
        intermediate=a[5].shape[-1],
        expert_bytes=sum(nbytes(t) // t.shape[0] for t in a[3:7] if isinstance(t, torch.Tensor)),
        element_bytes=a[0].element_size(),
    ),
    "qmoe_experts": lambda a: dict(
        tokens=a[0].shape[0],
        top_k=a[1].shape[1],
        experts=a[3].shape[0],
        hidden=a[0].shape[-1],
        intermediate=a[3].shape[1] // 2,
        expert_bytes=sum(nbytes(t) // t.shape[0] for t in a[3:12] if isinstance(t, torch.Tensor)),
        element_bytes=a[0].element_size(),
    ),
    "causal_conv1d": lambda a: dict(
        batch=a[0].shape[0],
        tokens=a[0].shape[2],
        channels=a[1].shape[0],
        width=a[1].shape[1],
        element_bytes=a[0].element_size(),
    ),
    "gated_delta_rule": _delta_extent,
    "gated_delta_step": _delta_extent,
    "ssd_scan": _ssd_extent,
    "ssd_step": _ssd_extent,
    "selective_scan": _selective_extent,
    "selective_step": _selective_extent,
    "qembedding": lambda a: dict(
        rows=a[0].numel(),
        dim=a[5],
        bytes_per_row=sum(nbytes(t) // t.shape[0] for t in a[1:4] if t is not None),
        element_bytes=a[2].element_size(),
    ),
}
OP_KINDS = {
    "attention": "attention",
    "qkv_attention": "attention",
    "latent_attention": "attention",
    "rms_norm": "norm",
    "add_rms_norm": "norm",
    "rope": "elementwise",
    "silu_mul": "elementwise",
    "qlinear": "matmul",
    "moe_experts": "matmul",
    "qmoe_experts": "matmul",
    "qembedding": "embedding",
    "causal_conv1d": "recurrent",
    "gated_delta_rule": "recurrent",
    "gated_delta_step": "recurrent",
    "ssd_scan": "recurrent",
    "ssd_step": "recurrent",
    "selective_scan": "recurrent",
    "selective_step": "recurrent",
}


def _matmul_flops(target: Any, args: list[Any], out: torch.Tensor) -> int:
    """2 x multiply-adds: output elements x the contracted dimension."""
    if target is aten.addmm.default:
        return 2 * out.numel() * args[1].shape[-1]
    return 2 * out.numel() * args[0].shape[-1]


def _aten_cost(target: Any, args: list[Any], out: Any, constants: set[int]) -> Cost | None:
    """Cost of an aten op from its argument and output values; None for ops that move nothing. Inputs that
    are constants (`constants`: ids of weight tensors) count as weight bytes."""
    if target in FREE or not isinstance(out, torch.Tensor):
        return None
    if target in CASTS and args[0].dtype == out.dtype:
        return None  # a no-op cast returns its input
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    weights = sum(nbytes(t) for t in tensors if id(t) in constants)
    if target is aten.embedding.default:  # reads one table row per id
        rows = out.numel() * out.element_size()
        return Cost(0, rows + nbytes(args[1]) + nbytes(out), weight_bytes=rows)
    if target in GATHERS:  # reads as many elements as it writes, plus the indices
        return Cost(0, 2 * nbytes(out) + sum(nbytes(t) for t in tensors[1:]), weight_bytes=weights)
    moved = sum(nbytes(t) for t in tensors) + nbytes(out)
    if target in MATMULS:
        flops = _matmul_flops(target, args, out)
    elif target in REDUCTIONS:
        flops = tensors[0].numel()
    elif target in CASTS or target in (aten.cat.default, aten.clone.default, aten.contiguous.default):
        flops = 0
    else:  # elementwise: one operation per output element
        flops = out.numel()
    return Cost(flops, moved, weight_bytes=weights)


def _aten_kind(node: torch.fx.Node, head: torch.fx.Node | None) -> str:
    """matmul / lm_head / embedding by the op; the rest by the module it came from (a norm's elementwise
    ops count as norm), else elementwise."""
    if node is head:
        return "lm_head"
    if node.target in MATMULS:
        return "matmul"
    if node.target is aten.embedding.default:
        return "embedding"
    stack = node.meta.get("nn_module_stack") or {}
    module_class = str(list(stack.values())[-1][1]) if stack else ""
    return "norm" if module_class.endswith("Norm") else "elementwise"


def _value(env: dict[torch.fx.Node, Any], arg: Any) -> Any:
    if isinstance(arg, torch.fx.Node):
        return env[arg]
    if isinstance(arg, (list, tuple)):
        return type(arg)(_value(env, a) for a in arg)
    return arg


def step_cost(program: Program, step: Step) -> StepCost:
    """The cost of every node of `program` that computes or moves data, for `step`."""
    env = propagate(program, step)
    gm = program.graph_module
    constants = {id(env[n]) for n in gm.graph.nodes if n.op == "get_attr"}
    heads = {*MATMULS, OPS["qlinear"].overload}
    head = lm_head(gm, output_node_for(gm, program.output_names, LOGITS), heads)
    nodes = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        args = [_value(env, a) for a in node.args]
        opdef = op_of(node.target)
        if opdef is not None:
            cost = opdef.cost(**OP_ARGUMENTS[opdef.name](args))
            kind = "lm_head" if node is head else OP_KINDS[opdef.name]
        else:
            cost = _aten_cost(node.target, args, env[node], constants)
            kind = _aten_kind(node, head)
        if cost is not None:
            nodes.append(NodeCost(node.name, opdef.name if opdef else str(node.target), kind, cost))
    return StepCost(step, nodes)


def decode_read_bytes(program: Program, context: int) -> int:
    """Bytes one decoded token reads (batch 1): every weight it uses plus the KV cache at `context` positions,
    what bounds decode speed at the memory bandwidth."""
    total = step_cost(program, decode_step(1, context)).total
    return total.weight_bytes + total.kv_read_bytes
