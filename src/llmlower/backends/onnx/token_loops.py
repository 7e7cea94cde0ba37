"""Recurrences over a step's tokens as ONNX Loops, for the recurrent ops of hybrid models: token by token, or chunk by
chunk where an op has a chunked form (an iteration then reads chunk i of arrays laid out [chunks, batch, heads,
size, ...], and `valid` [chunks, batch, size]).

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

DOMAIN = "llmlower.onnx"
LOOPS = onnxscript.values.Opset(DOMAIN, 1)
FLOAT = onnx.TensorProto.FLOAT


@dataclass(frozen=True)
class TokenLoop:
    """A stand-in op: its per-token arrays, the constants its body reads whole, and the body's nodes, which read
    `S` and `<name>_t` (token i of each array) and the constants by name and write `S_updated` and `out_t`. `idle`
    names per-token arrays of [batch, n] and the value each takes at a padded token, with which the body leaves S
    unchanged to the bit."""

    name: str
    arrays: tuple[str, ...]
    constants: tuple[str, ...]
    body: Callable[[dict[str, str]], list[onnx.NodeProto]]
    idle: dict[str, float]


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


def _body(loop: TokenLoop, outer: list[str]) -> onnx.GraphProto:
    """(i, cond, S) -> (cond, S', out_i): token i of the outer arrays (the idle ones where the token is padding),
    then the loop's own nodes."""
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
        *loop.body(constants),
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


def expand_token_loops(model: onnx.ModelProto) -> int:
    """Replace each stand-in of `model` by its Loop over tokens (the trip count is the first array's length), in
    place; returns how many."""
    graph, count = model.graph, 0
    for index, node in reversed(list(enumerate(graph.node))):
        if node.domain != DOMAIN:
            continue
        loop = REGISTERED[node.op_type]
        prefix = f"{node.op_type}_{index}"
        nodes = [
            helper.make_node("Shape", [node.input[0]], [f"{prefix}_tokens"], start=0, end=1),
            constant(f"{prefix}_axis0", [0]),
            helper.make_node("Squeeze", [f"{prefix}_tokens", f"{prefix}_axis0"], [f"{prefix}_trips"]),
            helper.make_node("Constant", [], [f"{prefix}_true"], value=numpy_helper.from_array(np.array(True))),
            helper.make_node(
                "Loop",
                [f"{prefix}_trips", f"{prefix}_true", node.input[-1]],
                [node.output[1], node.output[0]],
                name=prefix,
                body=_body(loop, list(node.input)),
            ),
        ]
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
