"""Recurrences over a step's tokens as ONNX Loops, for the recurrent ops of hybrid models.

A step of one token (decode) loops over tokens. Where an op has a chunked form, a step of more (a prompt) loops over
chunks of up to CHUNK tokens instead (an If on the token count picks): an iteration then reads chunk i of the arrays
laid out [chunks, batch, heads, size, ...] and of `valid` [chunks, batch, size], the last chunk zero-padded (its
padding invalid, hence idle), and the chunks' outputs are laid out token-first again after the Loop.

torch.onnx's exporter gives a traced node only the outputs its schema lists, which for Loop is one (variadic). A
lowering therefore emits a stand-in node of this module's domain, with the outputs (out, final state), and
`expand_token_loops` turns each stand-in into its Loop once the model is exported. A stand-in takes token-first
arrays [tokens, ...] (each iteration reads token i of them), the mask `valid` [tokens, batch] of each sequence's
real tokens, constants the body reads whole, and the state to start from last; its body says how one token moves
the state S and what it outputs. A sequence's state moves only at its valid tokens: at the others, the loop's
`idle` inputs (a decay's exponent 0, a write's weight 0) are given the values that leave S exactly as it is, so
that no pass over the state masks it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnx
import onnxscript
from onnx import helper, numpy_helper

from ...ir.chunk_scan import CHUNK

DOMAIN = "llmlower.onnx"
LOOPS = onnxscript.values.Opset(DOMAIN, 1)
FLOAT = onnx.TensorProto.FLOAT


@dataclass(frozen=True)
class TokenLoop:
    """A stand-in op: its per-token arrays, the constants its body reads whole, and the body's nodes, which read
    `S` and `<name>_t` (token i of each array) and the constants by name and write `S_updated` and `out_t`. `idle`
    names per-token arrays of [batch, n] and the value each takes at a padded token, with which the body leaves S
    unchanged to the bit. `chunk_body`, where the op has a chunked form: the same for chunk i (`<name>_t` [batch,
    heads, size, ...]); `ranks`, each array's rank token-first, to lay it out in chunks."""

    name: str
    arrays: tuple[str, ...]
    constants: tuple[str, ...]
    body: Callable[[dict[str, str]], list[onnx.NodeProto]]
    idle: dict[str, float]
    chunk_body: Callable[[dict[str, str]], list[onnx.NodeProto]] | None = None
    ranks: tuple[int, ...] = ()


REGISTERED: dict[str, TokenLoop] = {}


def register_token_loop(loop: TokenLoop) -> None:
    """Make `loop` a stand-in onnxscript can build (LOOPS.<name>) and expand_token_loops can expand."""
    parameter = onnx.defs.OpSchema.FormalParameter
    if not onnx.defs.has(loop.name, DOMAIN):
        onnx.defs.register_schema(
            onnx.defs.OpSchema(
                loop.name,
                DOMAIN,
                1,
                f"stand-in for a Loop over tokens ({loop.name}), expanded after export",
                inputs=[parameter(n, "T") for n in loop.arrays]
                + [parameter("valid", "B")]
                + [parameter(n, "T") for n in loop.constants]
                + [parameter("state", "T")],
                outputs=[parameter("out", "T"), parameter("final_state", "T")],
                type_constraints=[("T", ["tensor(float)"], "float32"), ("B", ["tensor(bool)"], "mask")],
            )
        )
    REGISTERED[loop.name] = loop


def constant(name: str, values: list[int]) -> onnx.NodeProto:
    """An int64 constant node (axes for Unsqueeze and ReduceSum)."""
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.array(values, dtype=np.int64)))


def _body(loop: TokenLoop, outer: list[str], step: Callable[[dict[str, str]], list[onnx.NodeProto]]) -> onnx.GraphProto:
    """(i, cond, S) -> (cond, S', out_i): token (or chunk) i of the outer arrays (the idle ones where the token is
    padding), then the `step` body's nodes."""
    arrays, valid = outer[: len(loop.arrays)], outer[len(loop.arrays)]
    constants = dict(zip(loop.constants, outer[len(loop.arrays) + 1 : -1], strict=True))
    nodes = [
        helper.make_node("Gather", [valid, "i"], ["valid_t"], axis=0),
        constant("batch_axes", [1]),
        helper.make_node("Unsqueeze", ["valid_t", "batch_axes"], ["valid2"]),  # [batch, 1]
    ]
    for role, name in zip(loop.arrays, arrays, strict=True):
        if role not in loop.idle:
            nodes.append(helper.make_node("Gather", [name, "i"], [f"{role}_t"], axis=0))
            continue
        idle = numpy_helper.from_array(np.array(loop.idle[role], dtype=np.float32))
        nodes += [
            helper.make_node("Gather", [name, "i"], [f"{role}_given"], axis=0),
            helper.make_node("Constant", [], [f"{role}_idle"], value=idle),
            helper.make_node("Where", ["valid2", f"{role}_given", f"{role}_idle"], [f"{role}_t"]),
        ]
    nodes += [
        *step(constants),
        helper.make_node("Identity", ["S_updated"], ["S_next"]),
        helper.make_node("Identity", ["cond"], ["cond_next"]),
    ]
    return helper.make_graph(
        nodes,
        f"{loop.name}_token",
        [
            helper.make_tensor_value_info("i", onnx.TensorProto.INT64, []),
            helper.make_tensor_value_info("cond", onnx.TensorProto.BOOL, []),
            helper.make_tensor_value_info("S", FLOAT, None),
        ],
        [
            helper.make_tensor_value_info("cond_next", onnx.TensorProto.BOOL, []),
            helper.make_tensor_value_info("S_next", FLOAT, None),
            helper.make_tensor_value_info("out_t", FLOAT, None),
        ],
    )


def _loop(loop: TokenLoop, inputs: list[str], trips: str, outputs: list[str], prefix: str, step) -> onnx.NodeProto:
    """The Loop of `step` over `trips` iterations of `inputs` (a stand-in's), writing (final state, stacked out)."""
    return helper.make_node(
        "Loop", [trips, f"{prefix}_true", inputs[-1]], outputs, name=prefix, body=_body(loop, inputs, step)
    )


def _chunked(loop: TokenLoop, inputs: list[str], tokens: str, out: str, prefix: str) -> list[onnx.NodeProto]:
    """Nodes that lay the arrays and `valid` out in chunks (padded), loop over the chunks with the chunked body, and
    write (final state, out token-first) as `out`_state and `out`. `tokens`: the step's token count, [1]."""
    node, names = helper.make_node, [*inputs[: len(loop.arrays) + 1]]
    p = f"{prefix}_chunk"
    nodes = [
        constant(f"{p}_limit", [CHUNK]),
        constant(f"{p}_one", [1]),
        constant(f"{p}_zero", [0]),
        constant(f"{p}_back", [-1]),
        node("Min", [tokens, f"{p}_limit"], [f"{p}_size"]),
        node("Add", [tokens, f"{p}_size"], [f"{p}_over"]),
        node("Sub", [f"{p}_over", f"{p}_one"], [f"{p}_ceiling"]),
        node("Div", [f"{p}_ceiling", f"{p}_size"], [f"{p}_count"]),
        node("Mul", [f"{p}_count", f"{p}_size"], [f"{p}_padded"]),
        node("Sub", [f"{p}_padded", tokens], [f"{p}_padding"]),
        node("Squeeze", [f"{p}_count", f"{p}_zero"], [f"{p}_trips"]),
    ]
    chunked = []
    for index, (name, rank) in enumerate(zip(names, (*loop.ranks, 2), strict=True)):
        q = f"{p}_{index}"
        perm = [0, 2, 1] if rank == 2 else [0, 2, 3, 1, *range(4, rank + 1)]
        nodes += [
            constant(f"{q}_before", [0] * rank),
            constant(f"{q}_after_rest", [0] * (rank - 1)),
            node("Concat", [f"{q}_before", f"{p}_padding", f"{q}_after_rest"], [f"{q}_pads"], axis=0),
            node("Pad", [name, f"{q}_pads"], [f"{q}_padded"]),
            node("Shape", [name], [f"{q}_rest"], start=1),
            node("Concat", [f"{p}_count", f"{p}_size", f"{q}_rest"], [f"{q}_shape"], axis=0),
            node("Reshape", [f"{q}_padded", f"{q}_shape"], [f"{q}_split"]),
            node("Transpose", [f"{q}_split"], [f"{q}_chunks"], perm=perm),
        ]
        chunked.append(f"{q}_chunks")
    chunk_inputs = [*chunked, *inputs[len(loop.arrays) + 1 :]]
    nodes += [
        _loop(loop, chunk_inputs, f"{p}_trips", [f"{out}_state", f"{p}_outs"], prefix, loop.chunk_body),
        node("Transpose", [f"{p}_outs"], [f"{p}_ordered"], perm=[0, 3, 1, 2, 4]),  # [chunks, size, batch, heads, d]
        node("Shape", [f"{p}_ordered"], [f"{p}_inner"], start=2),
        node("Concat", [f"{p}_back", f"{p}_inner"], [f"{p}_flat_shape"], axis=0),
        node("Reshape", [f"{p}_ordered", f"{p}_flat_shape"], [f"{p}_flat"]),
        node("Slice", [f"{p}_flat", f"{p}_zero", tokens, f"{p}_zero"], [out]),
    ]
    return nodes


def _branch(name: str, nodes: list[onnx.NodeProto], outputs: list[str]) -> onnx.GraphProto:
    """An If branch: `nodes`, reading the outer graph's values, writing `outputs`."""
    return helper.make_graph(nodes, name, [], [helper.make_tensor_value_info(o, FLOAT, None) for o in outputs])


def _expansion(loop: TokenLoop, node: onnx.NodeProto, prefix: str) -> list[onnx.NodeProto]:
    """A stand-in's nodes: its Loop over tokens, or, for an op with a chunked form, an If that runs a step of more
    than one token over chunks and a step of one over tokens."""
    inputs, (out, final) = list(node.input), node.output
    nodes = [
        helper.make_node("Shape", [inputs[0]], [f"{prefix}_tokens"], start=0, end=1),
        constant(f"{prefix}_axis0", [0]),
        helper.make_node("Squeeze", [f"{prefix}_tokens", f"{prefix}_axis0"], [f"{prefix}_trips"]),
        helper.make_node("Constant", [], [f"{prefix}_true"], value=numpy_helper.from_array(np.array(True))),
    ]
    if loop.chunk_body is None:
        return [*nodes, _loop(loop, inputs, f"{prefix}_trips", [final, out], prefix, loop.body)]
    one = numpy_helper.from_array(np.array(1, dtype=np.int64))
    by_tokens = _loop(loop, inputs, f"{prefix}_trips", [f"{prefix}_t_state", f"{prefix}_t_out"], prefix, loop.body)
    by_chunks = _chunked(loop, inputs, f"{prefix}_tokens", f"{prefix}_c_out", prefix)
    return [
        *nodes,
        helper.make_node("Constant", [], [f"{prefix}_single"], value=one),
        helper.make_node("Greater", [f"{prefix}_trips", f"{prefix}_single"], [f"{prefix}_prompt"]),
        helper.make_node(
            "If",
            [f"{prefix}_prompt"],
            [final, out],
            then_branch=_branch(f"{prefix}_chunks", by_chunks, [f"{prefix}_c_out_state", f"{prefix}_c_out"]),
            else_branch=_branch(f"{prefix}_tokens", [by_tokens], [f"{prefix}_t_state", f"{prefix}_t_out"]),
        ),
    ]


def expand_token_loops(model: onnx.ModelProto) -> int:
    """Replace each stand-in of `model` by its Loop (the trip count is the first array's length; an If choosing
    between chunks and tokens where the op has a chunked form), in place; returns how many."""
    graph, count = model.graph, 0
    for index, node in reversed(list(enumerate(graph.node))):
        if node.domain != DOMAIN:
            continue
        nodes = _expansion(REGISTERED[node.op_type], node, f"{node.op_type}_{index}")
        graph.node.remove(node)
        for offset, new in enumerate(nodes):
            graph.node.insert(index + offset, new)
        count += 1
    kept = [o for o in model.opset_import if o.domain != DOMAIN]
    if count and "com.microsoft" not in {o.domain for o in kept}:  # a body's contrib ops (Inverse)
        kept.append(helper.make_opsetid("com.microsoft", 1))
    del model.opset_import[:]
    model.opset_import.extend(kept)
    return count
