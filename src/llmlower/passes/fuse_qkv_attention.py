"""fuse_qkv_attention: slices of a fused qkv projection -> rope -> attention -> [B, T, H*D] becomes one
`qkv_attention`, with the rotary cos/sin precomputed as tables over every position."""

from __future__ import annotations

import operator
from dataclasses import replace
from typing import Any

import torch
import torch.fx

from ..ir.attention import ATTENTION
from ..ir.program import POSITION_IDS, Program, fetch_attr
from ..ir.qkv_attention import QKV_ATTENTION
from ..ir.rope import ROPE
from .graph_utils import RESHAPES, finish, placeholder, replace_uses, tensor_meta
from .registry import Pass, register_pass

aten = torch.ops.aten


def _head_split(node: torch.fx.Node) -> tuple[torch.fx.Node, int, int, torch.fx.Node] | None:
    """(source, start, end, view) for transpose(view(slice(source, -1, start, end), [B, T, h, D]), 1, 2)."""
    if node.target is not aten.transpose.int or sorted(node.args[1:]) != [1, 2]:
        return None
    view = node.args[0]
    if view.target not in RESHAPES or view.args[0].target is not aten.slice.Tensor:
        return None
    source, dim, start, end = view.args[0].args[:4]
    return (source, start, end, view) if dim in (-1, 2) else None


def _width(gm: torch.fx.GraphModule, node: torch.fx.Node) -> int | None:
    """Last dim of a [batch, tokens, width] node: from its metadata, or the weight of the linear making it."""
    meta = tensor_meta(node)
    if meta is not None:
        return meta.shape[-1] if meta.dim() == 3 else None
    if node.target is aten.linear.default and node.args[1].op == "get_attr":
        return fetch_attr(gm, node.args[1].target).shape[0]
    if node.target is aten.add.Tensor and isinstance(node.args[0], torch.fx.Node):  # + its LoRA adapters' outputs
        return _width(gm, node.args[0])
    return None


def _packed_output(out: torch.fx.Node) -> torch.fx.Node | None:
    """The node holding attention's output as [B, T, H*D]: after reshapes that keep its shape, a transpose of
    dims 1 and 2 and a reshape to rank 3."""
    node = out
    while len(node.users) == 1:
        user = next(iter(node.users))
        if (
            user.target in RESHAPES
            and tensor_meta(user) is not None
            and tensor_meta(user).shape == tensor_meta(node).shape
        ):
            node = user
        elif user.target is aten.transpose.int and sorted(user.args[1:]) == [1, 2] and len(user.users) == 1:
            packed = next(iter(user.users))
            meta = tensor_meta(packed)
            return packed if packed.target in RESHAPES and meta is not None and meta.dim() == 3 else None
        else:
            return None
    return None


def _evaluate(
    gm: torch.fx.GraphModule, node: torch.fx.Node, inputs: dict[torch.fx.Node, torch.Tensor]
) -> torch.Tensor | None:
    """Run the subgraph computing `node` from `inputs` and constants; None if it needs another input."""
    values: dict[torch.fx.Node, Any] = dict(inputs)

    def run(n: torch.fx.Node) -> Any:
        if n not in values:
            if n.op == "get_attr":
                values[n] = fetch_attr(gm, n.target)
            elif n.op == "call_function":
                args, kwargs = torch.fx.node.map_arg((n.args, n.kwargs), run)
                values[n] = n.target(*args, **kwargs)
            else:
                raise LookupError(n.name)
        return values[n]

    try:
        return run(node)
    except LookupError:
        return None


def _rotary_table(gm: torch.fx.GraphModule, cos: torch.fx.Node, head_dim: int, positions: int) -> torch.Tensor | None:
    """cos (or sin) for every position, [positions, head_dim / 2], if the graph computes it from position_ids
    alone and both halves of a head share it (rotate_half layout)."""
    ids = torch.arange(positions)[None]
    with torch.no_grad():
        value = _evaluate(gm, cos, {placeholder(gm, POSITION_IDS): ids})
    if value is None or value.numel() != positions * head_dim:
        return None
    table = value.reshape(positions, head_dim)
    half = head_dim // 2
    return table[:, :half].contiguous() if torch.equal(table[:, :half], table[:, half:]) else None


def fuse_qkv_attention(program: Program) -> tuple[Program, dict[str, Any]]:
    gm = program.graph_module
    graph = gm.graph
    tables: dict[torch.fx.Node, str | None] = {}  # a cos/sin node -> the buffer holding its table
    buffers: list[tuple[torch.Tensor, str]] = []  # each layer computes the same cos/sin: store each once

    def table_for(node: torch.fx.Node, head_dim: int) -> str | None:
        if node not in tables:
            table = _rotary_table(gm, node, head_dim, program.spec.max_positions)
            same = [name for stored, name in buffers if table is not None and torch.equal(stored, table)]
            tables[node] = same[0] if same else None if table is None else f"rotary_table_{len(buffers)}"
            if table is not None and not same:
                gm.register_buffer(tables[node], table)
                buffers.append((table, tables[node]))
        return tables[node]

    fused = 0
    for node in list(graph.nodes):
        if node.target is not ATTENTION.overload:
            continue
        q, k, v, k_cache, v_cache, past_lens, input_lens, scale = node.args[:8]
        extras = node.args[8:]  # window, softcap, sinks: passed on as they are (positionally or by name)
        if q.target is not ROPE.overload or k.target is not ROPE.overload or q.args[1:] != k.args[1:]:
            continue
        splits = [_head_split(x) for x in (q.args[0], k.args[0], v)]
        if None in splits or len({s[0] for s in splits}) != 1:
            continue
        source, head_dim = splits[0][0], program.spec.head_dim
        width = _width(gm, source)
        q_width, k_width, v_width = (s[2] - s[1] for s in splits)
        bounds = [(s[1], min(s[2], width or 0)) for s in splits]
        if bounds != [(0, q_width), (q_width, q_width + k_width), (q_width + k_width, q_width + k_width + v_width)]:
            continue
        cos, sin = (table_for(n, head_dim) for n in q.args[1:])
        packed = _packed_output(next(u for u in node.users if u.args[1] == 0))
        if cos is None or sin is None or packed is None:
            continue
        with graph.inserting_before(node):
            args = (source, k_cache, v_cache, past_lens, input_lens, graph.get_attr(cos), graph.get_attr(sin))
            new = graph.call_function(
                QKV_ATTENTION.overload,
                (*args, q_width // head_dim, k_width // head_dim, scale, *extras),
                dict(node.kwargs),
            )
            outputs = [graph.call_function(operator.getitem, (new, i)) for i in range(3)]
        old = {user.args[1]: user for user in node.users}
        replace_uses([packed, old[1], old[2]], outputs)
        fused += 1
    finish(gm)
    return replace(program, fresh_meta=program.fresh_meta and not fused), {"qkv_attention": fused}


register_pass(
    Pass(
        name="fuse_qkv_attention",
        summary="qkv slices + rope + attention -> qkv_attention (rotary tables precomputed)",
        explain=(
            "Matches attention whose q, k and v are head-split slices of one projection, q and k rotated by "
            "rope with the same cos/sin, and whose output is transposed back to [batch, tokens, heads * "
            "head_dim]; replaces it with llmlower::qkv_attention over the projection. The cos/sin are "
            "evaluated once for every position up to max_positions (they must depend on position_ids only) "
            "and stored as tables. Runs after kv_cache. Models with q/k norms (Qwen3) or without rotary "
            "(GPT-2) are left unchanged."
        ),
        run=fuse_qkv_attention,
    )
)
