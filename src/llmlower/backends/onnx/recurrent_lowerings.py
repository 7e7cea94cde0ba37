"""ONNX lowerings of the recurrent ops of hybrid models, in standard ops (ONNX Runtime has no contrib op for them on
the CPU): the step's state is an input and an output of the graph, as the KV cache is."""

from __future__ import annotations

import numpy as np
import onnx
from onnxscript import opset18 as op

from .token_loops import LOOPS, TokenLoop, constant, register_token_loop


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


def _tokens_first(x, group: int = 1):
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


def _start_and_valid(state, past_lens, input_lens, tokens_first):
    """The state to start from (zeros for a fresh sequence) and valid [tokens, batch]: token t < input_lens."""
    axes = list(range(1, len(state.shape)))
    fresh = op.Unsqueeze(op.Equal(past_lens, op.Constant(value_int=0)), op.Constant(value_ints=axes))
    start = op.Where(fresh, op.Constant(value_float=0.0), state)
    tokens = op.Squeeze(op.Shape(tokens_first, start=0, end=1))
    steps = op.Unsqueeze(
        op.Range(op.Constant(value_int=0), tokens, op.Constant(value_int=1)), op.Constant(value_ints=[1])
    )
    return start, op.Less(steps, op.Unsqueeze(input_lens, op.Constant(value_ints=[0])))


def _delta_token(constants: dict[str, str]) -> list[onnx.NodeProto]:
    """One token of the delta rule: S decays by exp(g), takes k beta (v - k S), and is read by q. S is read once
    for both q S and k S (one MatMul), and the output q S' = exp(g) q S + (q · k) delta needs no second read."""
    node = onnx.helper.make_node
    return [
        constant("axis2", [2]),
        constant("axis3", [3]),
        constant("first", [0]),
        constant("second", [1]),
        node("Exp", ["g_t"], ["decay"]),  # [batch, heads]
        node("Unsqueeze", ["decay", "axis2"], ["decay3"]),
        node("Unsqueeze", ["decay3", "axis3"], ["decay4"]),
        node("Unsqueeze", ["q_t", "axis2"], ["q3"]),  # [batch, heads, 1, dk]
        node("Unsqueeze", ["k_t", "axis2"], ["k3"]),
        node("Concat", ["q3", "k3"], ["qk"], axis=2),  # [batch, heads, 2, dk]
        node("MatMul", ["qk", "S"], ["qk_S"]),  # [batch, heads, 2, dv]: the state's one read
        node("Gather", ["qk_S", "first"], ["q_S"], axis=2),
        node("Gather", ["qk_S", "second"], ["k_S"], axis=2),
        node("Squeeze", ["q_S", "axis2"], ["q_S3"]),  # [batch, heads, dv]
        node("Squeeze", ["k_S", "axis2"], ["k_S3"]),
        node("Mul", ["k_S3", "decay3"], ["predicted"]),
        node("Sub", ["v_t", "predicted"], ["error"]),
        node("Unsqueeze", ["beta_t", "axis2"], ["beta3"]),
        node("Mul", ["error", "beta3"], ["delta"]),  # [batch, heads, dv]
        node("Unsqueeze", ["delta", "axis2"], ["delta4"]),  # [batch, heads, 1, dv]
        node("Unsqueeze", ["k_t", "axis3"], ["k4"]),  # [batch, heads, dk, 1]
        node("MatMul", ["k4", "delta4"], ["update"]),  # k delta^T
        node("Mul", ["S", "decay4"], ["decayed"]),
        node("Add", ["decayed", "update"], ["S_updated"]),
        node("Mul", ["q_t", "k_t"], ["q_times_k"]),
        node("ReduceSum", ["q_times_k", "axis2"], ["q_dot_k"]),  # [batch, heads, 1]
        node("Mul", ["q_S3", "decay3"], ["q_S_decayed"]),
        node("Mul", ["q_dot_k", "delta"], ["q_update"]),
        node("Add", ["q_S_decayed", "q_update"], ["out_t"]),
    ]


def _ssd_token(constants: dict[str, str]) -> list[onnx.NodeProto]:
    """One token of Mamba-2's scan: S decays by exp(dt A), takes dt x B^T, and is read by C, as
    S' C = exp(dt A) S C + (B · C) dt x: S is read once (one MatMul) besides its update."""
    node = onnx.helper.make_node
    return [
        constant("axis2", [2]),
        constant("axis3", [3]),
        node("Mul", ["dt_t", constants["a"]], ["dt_a"]),  # [batch, heads]
        node("Exp", ["dt_a"], ["decay"]),
        node("Unsqueeze", ["decay", "axis2"], ["decay3"]),
        node("Unsqueeze", ["decay3", "axis3"], ["decay4"]),
        node("Unsqueeze", ["c_t", "axis3"], ["c4"]),  # [batch, heads, state, 1]
        node("MatMul", ["S", "c4"], ["S_c"]),  # [batch, heads, head_dim, 1]: the state's one read
        node("Squeeze", ["S_c", "axis3"], ["S_c3"]),
        node("Unsqueeze", ["dt_t", "axis2"], ["dt3"]),
        node("Mul", ["dt3", "x_t"], ["dt_x"]),  # [batch, heads, head_dim]
        node("Unsqueeze", ["dt_x", "axis3"], ["dt_x4"]),
        node("Unsqueeze", ["b_t", "axis2"], ["b4"]),  # [batch, heads, 1, state]
        node("MatMul", ["dt_x4", "b4"], ["update"]),  # dt x B^T
        node("Mul", ["S", "decay4"], ["decayed"]),  # [batch, heads, head_dim, state]
        node("Add", ["decayed", "update"], ["S_updated"]),
        node("Mul", ["b_t", "c_t"], ["b_times_c"]),
        node("ReduceSum", ["b_times_c", "axis2"], ["b_dot_c"]),  # [batch, heads, 1]
        node("Mul", ["S_c3", "decay3"], ["S_c_decayed"]),
        node("Mul", ["b_dot_c", "dt_x"], ["c_update"]),
        node("Add", ["S_c_decayed", "c_update"], ["out_t"]),  # [batch, heads, head_dim]
    ]


def _pairwise_decay(cumulative: str, name: str) -> list[onnx.NodeProto]:
    """exp(cumulative[t] - cumulative[i]) for i <= t, else 0 ([batch, heads, size, size], as `name`): the gaps above
    the diagonal (positive) are zeroed before the exp and after it."""
    node = onnx.helper.make_node
    return [
        node("Unsqueeze", [cumulative, "axis3"], [f"{name}_rows"]),
        node("Unsqueeze", [cumulative, "axis2"], [f"{name}_columns"]),
        node("Sub", [f"{name}_rows", f"{name}_columns"], [f"{name}_gap"]),
        node("Trilu", [f"{name}_gap"], [f"{name}_causal_gap"], upper=0),
        node("Exp", [f"{name}_causal_gap"], [f"{name}_all"]),
        node("Trilu", [f"{name}_all"], [name], upper=0),
    ]


def _chunk_decays(log_decay: str) -> list[onnx.NodeProto]:
    """From a chunk's log decay per token [batch, heads, size]: `cumulative` (its running sum), `through` (the decay
    from the chunk's start through each token, [.., size, 1]), `to_end` (from each token to the chunk's end, [..,
    size, 1]), `whole` (the chunk's, [.., 1, 1]) and `decay` (token to token)."""
    node = onnx.helper.make_node
    return [
        constant("axis2", [2]),
        constant("axis3", [3]),
        constant("last", [-1]),
        constant("end", [2**62]),
        node("CumSum", [log_decay, "axis2"], ["cumulative"]),
        node("Exp", ["cumulative"], ["through3"]),
        node("Unsqueeze", ["through3", "axis3"], ["through"]),
        node("Slice", ["cumulative", "last", "end", "axis2"], ["cumulative_last"]),  # [batch, heads, 1]
        node("Sub", ["cumulative_last", "cumulative"], ["to_end_log"]),
        node("Exp", ["to_end_log"], ["to_end3"]),
        node("Unsqueeze", ["to_end3", "axis3"], ["to_end"]),
        node("Exp", ["cumulative_last"], ["whole3"]),
        node("Unsqueeze", ["whole3", "axis3"], ["whole"]),
        *_pairwise_decay("cumulative", "decay"),
    ]


def _delta_chunk(constants: dict[str, str]) -> list[onnx.NodeProto]:
    """One chunk of the delta rule in its parallel form (ir/gated_delta_rule.py): the corrections u solve a unit lower
    triangular system (com.microsoft.Inverse), then out = G Q S + (Q K^T * decay) u and S <- G_last S + (K G_last /
    G)^T u."""
    node = onnx.helper.make_node
    return [
        *_chunk_decays("g_t"),
        node("Unsqueeze", ["beta_t", "axis3"], ["beta4"]),  # [batch, heads, size, 1]
        node("Mul", ["k_t", "beta4"], ["k_beta"]),
        node("Transpose", ["k_t"], ["k_T"], perm=[0, 1, 3, 2]),
        node("MatMul", ["k_beta", "k_T"], ["k_beta_k"]),  # [batch, heads, size, size]
        node("Mul", ["k_beta_k", "decay"], ["k_beta_k_decayed"]),
        node("Constant", [], ["below"], value=onnx.numpy_helper.from_array(np.array(-1))),
        node("Trilu", ["k_beta_k_decayed", "below"], ["strictly_lower"], upper=0),
        node("Shape", ["strictly_lower"], ["square_shape"], start=2),
        node("ConstantOfShape", ["square_shape"], ["square"]),
        node("EyeLike", ["square"], ["identity"]),
        node("Add", ["strictly_lower", "identity"], ["system"]),
        node("Inverse", ["system"], ["system_inverse"], domain="com.microsoft"),
        node("Mul", ["v_t", "beta4"], ["v_beta"]),
        node("Mul", ["k_beta", "through"], ["k_beta_through"]),
        node("MatMul", ["k_beta_through", "S"], ["predicted"]),  # [batch, heads, size, dv]
        node("Sub", ["v_beta", "predicted"], ["targets"]),
        node("MatMul", ["system_inverse", "targets"], ["corrections"]),
        node("Mul", ["q_t", "through"], ["q_through"]),
        node("MatMul", ["q_through", "S"], ["q_S"]),
        node("MatMul", ["q_t", "k_T"], ["q_k"]),
        node("Mul", ["q_k", "decay"], ["q_k_decayed"]),
        node("MatMul", ["q_k_decayed", "corrections"], ["q_corrections"]),
        node("Add", ["q_S", "q_corrections"], ["out_t"]),
        node("Mul", ["k_t", "to_end"], ["k_to_end"]),
        node("Transpose", ["k_to_end"], ["k_to_end_T"], perm=[0, 1, 3, 2]),
        node("MatMul", ["k_to_end_T", "corrections"], ["carried"]),  # [batch, heads, dk, dv]
        node("Mul", ["S", "whole"], ["S_decayed"]),
        node("Add", ["S_decayed", "carried"], ["S_updated"]),
    ]


def _ssd_chunk(constants: dict[str, str]) -> list[onnx.NodeProto]:
    """One chunk of Mamba-2's scan in its parallel form (ir/ssd_scan.py): with x' = dt x, y = G (C S^T) + (C B^T *
    decay) x' and S <- G_last S + (x' G_last / G)^T B."""
    node = onnx.helper.make_node
    return [
        constant("axis1", [1]),
        node("Unsqueeze", [constants["a"], "axis1"], ["a_heads"]),  # [heads, 1]
        node("Mul", ["dt_t", "a_heads"], ["dt_a"]),  # [batch, heads, size]
        *_chunk_decays("dt_a"),
        node("Unsqueeze", ["dt_t", "axis3"], ["dt4"]),
        node("Mul", ["x_t", "dt4"], ["written"]),  # [batch, heads, size, head_dim]
        node("Transpose", ["S"], ["S_T"], perm=[0, 1, 3, 2]),
        node("MatMul", ["c_t", "S_T"], ["c_S"]),  # [batch, heads, size, head_dim]
        node("Mul", ["c_S", "through"], ["c_S_through"]),
        node("Transpose", ["b_t"], ["b_T"], perm=[0, 1, 3, 2]),
        node("MatMul", ["c_t", "b_T"], ["c_b"]),  # [batch, heads, size, size]
        node("Mul", ["c_b", "decay"], ["c_b_decayed"]),
        node("MatMul", ["c_b_decayed", "written"], ["c_written"]),
        node("Add", ["c_S_through", "c_written"], ["out_t"]),
        node("Mul", ["written", "to_end"], ["written_to_end"]),
        node("Transpose", ["written_to_end"], ["written_to_end_T"], perm=[0, 1, 3, 2]),
        node("MatMul", ["written_to_end_T", "b_t"], ["carried"]),  # [batch, heads, head_dim, state]
        node("Mul", ["S", "whole"], ["S_decayed"]),
        node("Add", ["S_decayed", "carried"], ["S_updated"]),
    ]


def _selective_token(constants: dict[str, str]) -> list[onnx.NodeProto]:
    """One token of Mamba's selective scan: S decays by exp(dt A) per channel and state, takes dt x B, is read by C."""
    node = onnx.helper.make_node
    return [
        constant("axis1", [1]),
        constant("axis2", [2]),
        node("Unsqueeze", ["dt_t", "axis2"], ["dt3"]),  # [batch, channels, 1]
        node("Mul", ["dt3", constants["a"]], ["dt_a"]),  # [batch, channels, state]
        node("Exp", ["dt_a"], ["decay"]),
        node("Mul", ["S", "decay"], ["decayed"]),
        node("Mul", ["dt_t", "x_t"], ["dt_x"]),  # [batch, channels]
        node("Unsqueeze", ["dt_x", "axis2"], ["dt_x3"]),
        node("Unsqueeze", ["b_t", "axis1"], ["b3"]),  # [batch, 1, state]
        node("Mul", ["dt_x3", "b3"], ["update"]),
        node("Add", ["decayed", "update"], ["S_updated"]),
        node("Unsqueeze", ["c_t", "axis1"], ["c3"]),
        node("Mul", ["S_updated", "c3"], ["read"]),
        node("ReduceSum", ["read", "axis2"], ["out_t"], keepdims=0),  # [batch, channels]
    ]


# a padded token leaves the state as it is: decay exp(0) = 1 and a write weighted by 0
register_token_loop(
    TokenLoop(
        "GatedDeltaScan",
        ("q", "k", "v", "g", "beta"),
        (),
        _delta_token,
        idle={"g": 0.0, "beta": 0.0},
        chunk_body=_delta_chunk,
        ranks=(4, 4, 4, 3, 3),
    )
)
register_token_loop(
    TokenLoop(
        "SsdScan",
        ("x", "dt", "b", "c"),
        ("a",),
        _ssd_token,
        idle={"dt": 0.0},
        chunk_body=_ssd_chunk,
        ranks=(4, 3, 4, 4),
    )
)
register_token_loop(TokenLoop("SelectiveScan", ("x", "dt", "b", "c"), ("a",), _selective_token, idle={"dt": 0.0}))


def _channels_last_first(x):
    """[batch, channels, tokens] -> [tokens, batch, channels] in float32."""
    return op.Cast(op.Transpose(x, perm=[2, 0, 1]), to=onnx.TensorProto.FLOAT)


def selective_step(x, dt, A, B, C, D, z, dt_bias, state, past_lens, input_lens, softplus: bool):
    """dt discretised, x, dt, B and C laid out tokens first in float32, the scan as a Loop over tokens, then D's
    skip connection and the silu(z) gate, in x's dtype."""
    dt = _channels_last_first(dt)  # [tokens, batch, channels]
    if dt_bias is not None:
        dt = op.Add(dt, op.Cast(dt_bias, to=onnx.TensorProto.FLOAT))
    if softplus:
        dt = op.Softplus(dt)
    first = _channels_last_first(x)
    start, valid = _start_and_valid(state, past_lens, input_lens, first)
    a = op.Cast(A, to=onnx.TensorProto.FLOAT)
    y, final = LOOPS.SelectiveScan(first, dt, _channels_last_first(B), _channels_last_first(C), valid, a, start)
    y = op.CastLike(op.Transpose(y, perm=[1, 2, 0]), x)  # [batch, channels, tokens]
    if D is not None:
        y = op.Add(y, op.Mul(x, op.Unsqueeze(op.CastLike(D, x), op.Constant(value_ints=[1]))))
    if z is not None:
        y = op.Mul(y, op.Mul(z, op.Sigmoid(z)))
    return y, final


def gated_delta_step(q, k, v, g, beta, state, past_lens, input_lens, use_qk_l2norm: bool):
    """The inputs laid out tokens first in float32 (q and k normalised, repeated to the value heads, q scaled), then
    the recurrence as a Loop over tokens (chunks of them for a prompt)."""
    group, scale, like = v.shape[2] // k.shape[2], float(q.shape[3]) ** -0.5, q
    q, k = _tokens_first(q, group), _tokens_first(k, group)
    if use_qk_l2norm:
        q, k = _l2_normalised(q), _l2_normalised(k)
    q = op.Mul(q, op.Constant(value_float=scale))
    start, valid = _start_and_valid(state, past_lens, input_lens, q)
    out, final = LOOPS.GatedDeltaScan(q, k, _tokens_first(v), _tokens_first(g), _tokens_first(beta), valid, start)
    return op.CastLike(op.Transpose(out, perm=[1, 0, 2, 3]), like), final


def ssd_step(x, dt, A, B, C, D, dt_bias, state, past_lens, input_lens, softplus: bool, dt_min: float, dt_max: float):
    """dt discretised, x, dt, B and C laid out tokens first in float32 (B and C repeated to the heads), the scan as
    a Loop over tokens (chunks of them for a prompt), then D's skip connection."""
    group = x.shape[2] // B.shape[2]
    dt = _tokens_first(dt)  # [tokens, batch, heads]
    if dt_bias is not None:
        dt = op.Add(dt, op.Cast(dt_bias, to=onnx.TensorProto.FLOAT))
    if softplus:
        dt = op.Softplus(dt)
    dt = op.Clip(dt, op.Constant(value_float=dt_min), op.Constant(value_float=min(dt_max, 3.4e38)))
    first = _tokens_first(x)
    start, valid = _start_and_valid(state, past_lens, input_lens, first)
    a = op.Cast(A, to=onnx.TensorProto.FLOAT)
    y, final = LOOPS.SsdScan(first, dt, _tokens_first(B, group), _tokens_first(C, group), valid, a, start)
    y = op.Transpose(y, perm=[1, 0, 2, 3])
    if D is not None:
        d = op.Unsqueeze(op.Cast(D, to=onnx.TensorProto.FLOAT), op.Constant(value_ints=[1]))
        y = op.Add(y, op.Mul(d, op.Cast(x, to=onnx.TensorProto.FLOAT)))
    return y, final
