"""Complex tensors rewritten as real pairs (a trailing dimension of 2: real, imaginary), for canonicalize.

Some models rotate q and k by multiplying them, viewed as complex numbers, by e^(i·angle) (Llama 4's rotary:
view_as_complex, polar, a complex mul, view_as_real). No backend has a complex dtype, so every complex value
becomes the real tensor view_as_real would give, and each op on it the same arithmetic on pairs: a complex
mul is four real muls, a dim counted from the end moves one further left. An op on complex values with no
rule here is refused by name rather than lowered wrong."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.fx

from ..errors import PassError
from ..ir.program import fetch_attr
from .graph_utils import tensor_meta

aten = torch.ops.aten
Fx = torch.fx.Graph
Node = torch.fx.Node

_REAL_DTYPE = {torch.complex32: torch.float16, torch.complex64: torch.float32, torch.complex128: torch.float64}
# ops whose dims are counted over the complex shape: (argument index of the dim or dim list, is a list)
_DIM_ARG = {
    aten.unsqueeze.default: (1, False),
    aten.squeeze.dim: (1, False),
    aten.squeeze.dims: (1, True),
    aten.select.int: (1, False),
    aten.slice.Tensor: (1, False),
    aten.transpose.int: ((1, 2), False),
    aten.cat.default: (1, False),
    aten.stack.default: (1, False),
    aten.index_select.default: (1, False),
    aten.flatten.using_ints: ((1, 2), False),
    aten.sum.dim_IntList: (1, True),
    aten.mean.dim: (1, True),
}
_SHAPE_ARG = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.expand.default}
_SAME = {  # the same op on pairs: linear in (real, imaginary) or a pure copy
    aten.clone.default,
    aten.contiguous.default,
    aten.alias.default,
    aten.detach.default,
    aten.neg.default,
}
_CASTS = {aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default, aten.type_as.default}


def _is_complex(value: object) -> bool:
    """True for a graph value that torch.export recorded as a complex tensor."""
    meta = tensor_meta(value) if isinstance(value, Node) else None
    return meta is not None and meta.is_complex()


def lower_complex(gm: torch.fx.GraphModule) -> int:
    """Rewrite every op on complex tensors in `gm` into real ops on pairs; the count of ops rewritten. The graph
    needs torch.export's metadata (which values are complex); the complex nodes are left dead."""
    graph, pairs, lowered = gm.graph, {}, 0
    for node in list(graph.nodes):
        takes = any(_is_complex(arg) for arg in node.all_input_nodes)
        gives = _is_complex(node)
        if not (takes or gives) or node.op == "output":
            continue
        with graph.inserting_before(node):
            if node.op == "get_attr":  # a complex weight: stored as its real view
                name = f"{node.target.replace('.', '_')}_pairs"
                gm.register_buffer(name, torch.view_as_real(fetch_attr(gm, node.target)).clone())
                result = graph.get_attr(name)
            elif node.op == "call_function":
                result = _lower(graph, node, pairs)
            else:
                raise PassError(f"canonicalize: input {node.name} is complex; the program's inputs must be real")
        if gives:
            pairs[node] = result
        else:
            node.replace_all_uses_with(result)
        lowered += 1
    return lowered


def _lower(graph: Fx, node: Node, pairs: dict[Node, Node]) -> Node:
    """The real node that stands for `node`: its pair if `node` is complex, else its own (real) value."""
    target, args = node.target, torch.fx.node.map_arg(node.args, lambda n: pairs.get(n, n))
    call: Callable[..., Node] = graph.call_function
    if target is aten.view_as_complex.default or target is aten.view_as_real.default:
        return args[0]  # the pair is the real view
    if target is aten.polar.default:
        magnitude, angle = args
        cos, sin = call(aten.cos.default, (angle,)), call(aten.sin.default, (angle,))
        return _stack(call, call(aten.mul.Tensor, (magnitude, cos)), call(aten.mul.Tensor, (magnitude, sin)))
    if target is aten.complex.default:
        return _stack(call, *args)
    if target in (aten.real.default, aten.imag.default):
        return _part(call, args[0], 0 if target is aten.real.default else 1)
    if target in (aten.mul.Tensor, aten.div.Tensor, aten.add.Tensor, aten.sub.Tensor):
        return _arithmetic(call, node, args)
    if target in (aten._conj.default, aten.conj_physical.default):
        return _stack(call, _part(call, args[0], 0), call(aten.neg.default, (_part(call, args[0], 1),)))
    if target in _SAME:
        return call(target, args, node.kwargs)
    if target in _CASTS and _is_complex(node) and _is_complex(node.args[0]):
        dtype = _REAL_DTYPE[tensor_meta(node).dtype]
        return call(aten._to_copy.default, (args[0],), {"dtype": dtype})
    if target in _SHAPE_ARG:
        return call(target, (args[0], [*args[1], 2], *args[2:]), node.kwargs)
    if target is aten.permute.default:
        return call(target, (args[0], [*map(_dim, args[1]), -1]))
    if target in _DIM_ARG:
        index, is_list = _DIM_ARG[target]
        args = list(args)
        for i in index if isinstance(index, tuple) else (index,):
            if i < len(args):
                args[i] = [_dim(d) for d in args[i]] if is_list else _dim(args[i])
        return call(target, tuple(args), node.kwargs)
    raise PassError(f"canonicalize: {node.name} ({target}) on a complex tensor has no real-pair form")


def _dim(dim: int) -> int:
    """A complex tensor's dim on its pair: one further left when counted from the end."""
    return dim - 1 if dim < 0 else dim


def _part(call: Callable[..., Node], pair: Node, index: int) -> Node:
    return call(aten.select.int, (pair, -1, index))


def _stack(call: Callable[..., Node], real: Node, imaginary: Node) -> Node:
    return call(aten.stack.default, ([real, imaginary], -1))


def _arithmetic(call: Callable[..., Node], node: Node, args: tuple) -> Node:
    """+, -, * and / with a complex operand: pairs add and subtract as they are, scale by a real operand (its
    last dim broadcast over the pair), and multiply as (a + bi)(c + di) = (ac - bd) + (ad + bc)i."""
    a, b = args[0], args[1]
    complex_a, complex_b = (_is_complex(x) for x in node.args[:2])
    if node.target in (aten.add.Tensor, aten.sub.Tensor):
        if not (complex_a and complex_b):
            raise PassError(f"canonicalize: {node.name} adds a real and a complex tensor; no real-pair form")
        return call(node.target, (a, b), node.kwargs)
    if complex_a and complex_b:
        if node.target is aten.div.Tensor:
            raise PassError(f"canonicalize: {node.name} divides two complex tensors; no real-pair form")
        ar, ai, br, bi = _part(call, a, 0), _part(call, a, 1), _part(call, b, 0), _part(call, b, 1)
        real = call(aten.sub.Tensor, (call(aten.mul.Tensor, (ar, br)), call(aten.mul.Tensor, (ai, bi))))
        imaginary = call(aten.add.Tensor, (call(aten.mul.Tensor, (ar, bi)), call(aten.mul.Tensor, (ai, br))))
        return _stack(call, real, imaginary)
    if not complex_a and node.target is aten.div.Tensor:
        raise PassError(f"canonicalize: {node.name} divides by a complex tensor; no real-pair form")
    pair, scale = (a, b) if complex_a else (b, a)
    if isinstance(scale, Node):
        scale = call(aten.unsqueeze.default, (scale, -1))
    return call(node.target, (pair, scale))
