"""ONNX lowerings of the recurrent ops of hybrid models, in standard ops (ONNX Runtime has no contrib op for them on
the CPU): the step's state is an input and an output of the graph, as the KV cache is."""

from __future__ import annotations

import numpy as np
import onnx
import onnxscript
from onnx import numpy_helper
from onnxscript import opset18 as op


def _constant(values: np.ndarray):
    return op.Constant(value=onnx.numpy_helper.from_array(values))


def causal_conv1d(x, weight, bias, state, past_lens, input_lens):
    """Conv over [state | new inputs] with one group a channel; the new state gathered at each sequence's last
    width - 1 inputs (GatherElements at input_lens + 0 .. width - 2). A fresh sequence (past_lens 0) reads zeros."""
    channels, width = weight.shape[0], weight.shape[1]
    fresh = op.Unsqueeze(op.Equal(past_lens, op.Constant(value_int=0)), op.Constant(value_ints=[1, 2]))
    window = op.Where(fresh, op.CastLike(op.Constant(value_float=0.0), state), state)
    full = op.Concat(op.CastLike(window, x), x, axis=2)
    kernel = op.Unsqueeze(weight, op.Constant(value_ints=[1]))
    conv_inputs = (full, kernel) if bias is None else (full, kernel, bias)
    out = op.Conv(*conv_inputs, group=channels, kernel_shape=[width])
    offsets = _constant(np.arange(width - 1, dtype=np.int64).reshape(1, 1, width - 1))
    ends = op.Add(op.Unsqueeze(input_lens, op.Constant(value_ints=[1, 2])), offsets)  # [batch, 1, width - 1]
    shape = op.Concat(op.Shape(x, start=0, end=1), op.Constant(value_ints=[channels, width - 1]), axis=0)
    updated = op.GatherElements(full, op.Expand(ends, shape), axis=2)
    return out, op.CastLike(updated, state)


# The delta rule's recurrence is an ONNX Loop over tokens. torch.onnx's exporter gives a traced node only the outputs
# its schema lists, which for Loop is one (variadic): the lowering emits this two-output stand-in, and
# expand_delta_scans turns each into the Loop once the model is exported.
SCAN_DOMAIN, SCAN_OP = "llmlower.onnx", "GatedDeltaScan"
SCAN = onnxscript.values.Opset(SCAN_DOMAIN, 1)
if not onnx.defs.has(SCAN_OP, SCAN_DOMAIN):
    _float = onnx.defs.OpSchema.FormalParameter
    onnx.defs.register_schema(
        onnx.defs.OpSchema(
            SCAN_OP,
            SCAN_DOMAIN,
            1,
            "stand-in for the delta rule's Loop over tokens (expanded after export)",
            inputs=[_float(name, "T") for name in ("q", "k", "v", "g", "beta")]
            + [_float("valid", "B"), _float("state", "T")],
            outputs=[_float("out", "T"), _float("final_state", "T")],
            type_constraints=[("T", ["tensor(float)"], "float32"), ("B", ["tensor(bool)"], "mask")],
        )
    )


def _tokens_first(x, group: int):
    """[batch, tokens, heads, ...] -> [tokens, batch, heads * group, ...] in float32 (each head repeated `group`
    times, consecutively, as repeat_interleave does)."""
    perm = [1, 0, 2, 3] if len(x.shape) == 4 else [1, 0, 2]
    if group > 1:
        shape = op.Shape(x)
        repeated = op.Expand(op.Unsqueeze(x, op.Constant(value_ints=[3])), op.Constant(value_ints=[1, 1, 1, group, 1]))
        x = op.Reshape(repeated, op.Concat(op.Slice(shape, [0], [2]), op.Constant(value_ints=[-1, x.shape[3]]), axis=0))
    return op.Cast(op.Transpose(x, perm=perm), to=onnx.TensorProto.FLOAT)


def _l2_normalised(x):
    total = op.ReduceSum(op.Mul(x, x), op.Constant(value_ints=[-1]), keepdims=1)
    return op.Mul(x, op.Reciprocal(op.Sqrt(op.Add(total, op.Constant(value_float=1e-6)))))


def gated_delta_step(q, k, v, g, beta, state, past_lens, input_lens, use_qk_l2norm: bool):
    """The inputs laid out tokens first in float32 (q and k normalised, repeated to the value heads, q scaled), the
    state zeroed for fresh sequences, then the recurrence as a Loop over tokens (GatedDeltaScan until expanded)."""
    group, scale, like = v.shape[2] // k.shape[2], float(q.shape[3]) ** -0.5, q
    q, k = _tokens_first(q, group), _tokens_first(k, group)
    if use_qk_l2norm:
        q, k = _l2_normalised(q), _l2_normalised(k)
    q = op.Mul(q, op.Constant(value_float=scale))
    v, g, beta = _tokens_first(v, 1), _tokens_first(g, 1), _tokens_first(beta, 1)
    fresh = op.Unsqueeze(op.Equal(past_lens, op.Constant(value_int=0)), op.Constant(value_ints=[1, 2, 3]))
    start = op.Where(fresh, op.Constant(value_float=0.0), state)
    tokens = op.Shape(q, start=0, end=1)
    steps = op.Range(op.Constant(value_int=0), op.Squeeze(tokens), op.Constant(value_int=1))
    valid = op.Less(
        op.Unsqueeze(steps, op.Constant(value_ints=[1])), op.Unsqueeze(input_lens, op.Constant(value_ints=[0]))
    )
    out, final = SCAN.GatedDeltaScan(q, k, v, g, beta, valid, start)
    return op.CastLike(op.Transpose(out, perm=[1, 0, 2, 3]), like), final


def _loop_body(q: str, k: str, v: str, g: str, beta: str, valid: str) -> onnx.GraphProto:
    """One token of the recurrence: (i, cond, S) -> (cond, S', out_i), reading token i of the outer q .. valid."""
    h = onnx.helper
    nodes = [
        h.make_node("Constant", [], ["axes23"], value=numpy_helper.from_array(np.array([2, 3], dtype=np.int64))),
        h.make_node("Constant", [], ["axis2"], value=numpy_helper.from_array(np.array([2], dtype=np.int64))),
        h.make_node("Constant", [], ["axis3"], value=numpy_helper.from_array(np.array([3], dtype=np.int64))),
        h.make_node("Constant", [], ["axes123"], value=numpy_helper.from_array(np.array([1, 2, 3], dtype=np.int64))),
        *(
            h.make_node("Gather", [outer, "i"], [f"{name}_t"], axis=0)
            for name, outer in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("valid", valid))
        ),
        h.make_node("Exp", ["g_t"], ["decay"]),
        h.make_node("Unsqueeze", ["decay", "axes23"], ["decay4"]),
        h.make_node("Mul", ["S", "decay4"], ["decayed"]),  # [b, h, dk, dv]
        h.make_node("Unsqueeze", ["k_t", "axis3"], ["k4"]),  # [b, h, dk, 1]
        h.make_node("Mul", ["decayed", "k4"], ["k_decayed"]),
        h.make_node("ReduceSum", ["k_decayed", "axis2"], ["predicted"], keepdims=0),  # [b, h, dv]
        h.make_node("Sub", ["v_t", "predicted"], ["error"]),
        h.make_node("Unsqueeze", ["beta_t", "axis2"], ["beta3"]),
        h.make_node("Mul", ["error", "beta3"], ["delta"]),
        h.make_node("Unsqueeze", ["delta", "axis2"], ["delta4"]),  # [b, h, 1, dv]
        h.make_node("Mul", ["k4", "delta4"], ["update"]),
        h.make_node("Add", ["decayed", "update"], ["updated"]),
        h.make_node("Unsqueeze", ["q_t", "axis3"], ["q4"]),
        h.make_node("Mul", ["updated", "q4"], ["read"]),
        h.make_node("ReduceSum", ["read", "axis2"], ["out_t"], keepdims=0),
        h.make_node("Unsqueeze", ["valid_t", "axes123"], ["valid4"]),
        h.make_node("Where", ["valid4", "updated", "S"], ["S_next"]),
        h.make_node("Identity", ["cond"], ["cond_next"]),
    ]
    floats = onnx.TensorProto.FLOAT
    return h.make_graph(
        nodes,
        "gated_delta_token",
        [
            h.make_tensor_value_info("i", onnx.TensorProto.INT64, []),
            h.make_tensor_value_info("cond", onnx.TensorProto.BOOL, []),
            h.make_tensor_value_info("S", floats, None),
        ],
        [
            h.make_tensor_value_info("cond_next", onnx.TensorProto.BOOL, []),
            h.make_tensor_value_info("S_next", floats, None),
            h.make_tensor_value_info("out_t", floats, None),
        ],
    )


def expand_delta_scans(model: onnx.ModelProto) -> int:
    """Replace each GatedDeltaScan stand-in of `model` by its Loop over tokens, in place; returns how many."""
    graph, count = model.graph, 0
    for index, node in reversed(list(enumerate(graph.node))):
        if node.domain != SCAN_DOMAIN or node.op_type != SCAN_OP:
            continue
        q, k, v, g, beta, valid, start = node.input
        prefix = f"{node.name or 'delta_scan'}_{index}"
        trips = [
            onnx.helper.make_node("Shape", [q], [f"{prefix}_tokens"], start=0, end=1),
            onnx.helper.make_node("Constant", [], [f"{prefix}_axis0"], value_ints=[0]),
            onnx.helper.make_node("Squeeze", [f"{prefix}_tokens", f"{prefix}_axis0"], [f"{prefix}_trips"]),
            onnx.helper.make_node("Constant", [], [f"{prefix}_true"], value=numpy_helper.from_array(np.array(True))),
        ]
        loop = onnx.helper.make_node(
            "Loop",
            [f"{prefix}_trips", f"{prefix}_true", start],
            [node.output[1], node.output[0]],
            name=prefix,
            body=_loop_body(q, k, v, g, beta, valid),
        )
        graph.node.remove(node)
        for offset, new in enumerate([*trips, loop]):
            graph.node.insert(index + offset, new)
        count += 1
    kept = [o for o in model.opset_import if o.domain != SCAN_DOMAIN]
    del model.opset_import[:]
    model.opset_import.extend(kept)
    return count
