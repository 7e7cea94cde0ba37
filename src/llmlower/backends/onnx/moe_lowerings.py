"""ONNX lowerings of the experts ops: `moe_experts` to com.microsoft.MoE, `qmoe_experts` to com.microsoft.QMoE.

Plain traced functions like lowerings.py's. Both contrib ops route by themselves (softmax over router logits,
top-k, renormalised): they are given log-weights at the chosen experts and UNCHOSEN_LOGIT elsewhere, so they pick
the model's experts with weights w / sum(w), and their output is scaled back by sum(w).

What onnxruntime 1.31's CPU QMoE takes (measured against the reference, tests/test_moe.py): 4- and 8-bit weights
in ir/quant.py's per-expert layout as they are ([E, N, K * bits / 8], MatMulNBits' bytes: the even element in the
low nibble), block-wise scales [E, N, K / block], packed uint8 zero points, interleaved SwiGLU with alpha, beta and
limit, biases. 4 bits at accuracy_level 0 computes in float32 (exact), at 4 with int8 activations; 8 bits always
quantizes activations to int8 (~1% error). It refuses float zero points, gate/up and down of different bits
("Mixed-width QMoE execution is not yet implemented on CPU"), one block size for both and sizes not divisible by it.
Mixed widths (q4mix: int4 gate/up, int8 down) therefore run as 8 bits, the int4 side widened to the same values
(q - zero + 128, folded into an initializer when the session loads). The other variants (and 8 bits at
accuracy_level 0, to stay exact) fall back to the float MoE over weights dequantized by graph ops, which ONNX
Runtime folds into float initializers when the session loads: exact, but the experts then take float32's memory
and bandwidth.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxscript
from onnxscript import opset18 as op

from ...ir.quant import GROUP_SIZES
from .schemas import ensure_schema

MSFT = onnxscript.values.Opset("com.microsoft", 1)
ensure_schema("com.microsoft", "MoE")
ensure_schema("com.microsoft", "QMoE")
UNCHOSEN_LOGIT = -1e9  # a router logit whose softmax weight is exactly 0


def _routing(x, expert_ids, expert_weights, experts: int) -> tuple:
    """(router logits [tokens, experts], the chosen experts' weights in x's dtype) for MoE/QMoE's own routing."""
    rows = op.Shape(x, start=0, end=1)
    shape = op.Concat(rows, op.Constant(value_ints=[experts]), axis=0)
    unchosen = op.Expand(op.CastLike(op.Constant(value_float=UNCHOSEN_LOGIT), x), shape)
    weights = op.CastLike(expert_weights, x)
    return op.ScatterElements(unchosen, expert_ids, op.Log(weights), axis=1), weights


def _gate(top_k: int, alpha: float, beta: float, limit: float) -> dict:
    """The attributes MoE and QMoE share: top-k routing renormalised, interleaved (clamped) SwiGLU."""
    clamp = {"swiglu_limit": limit} if limit > 0 else {}
    return dict(
        k=top_k,
        activation_type="swiglu",
        swiglu_fusion=1,
        activation_alpha=alpha,
        activation_beta=beta,
        normalize_routing_weights=1,
        **clamp,
    )


def _scaled_back(out, weights):
    return op.Mul(out, op.ReduceSum(weights, op.Constant(value_ints=[1]), keepdims=1))


def moe_experts(
    x, expert_ids, expert_weights, w_up, b_up, w_down, b_down, alpha: float = 1.0, beta: float = 0.0, limit: float = 0.0
):
    """ONNX Runtime's MoE: it runs only the chosen experts."""
    return _float_moe(x, expert_ids, expert_weights, (w_up, b_up, w_down, b_down), w_up.shape[0], (alpha, beta, limit))


def _float_moe(x, expert_ids, expert_weights, tensors: tuple, experts: int, gate: tuple[float, float, float]):
    """MoE over float (w_up, b_up, w_down, b_down) of `experts` experts (given: a computed weight's shape is unknown
    while tracing)."""
    logits, weights = _routing(x, expert_ids, expert_weights, experts)
    out = MSFT.MoE(x, logits, *tensors, **_gate(expert_ids.shape[1], *gate))
    return _scaled_back(out, weights)


def _byte(value: int):
    return op.Constant(value=onnx.numpy_helper.from_array(np.array(value, dtype=np.uint8)))


def _nibbles(packed):
    """uint8 [..., n] -> [..., 2n] values 0..15, the low nibble first (ir/quant.py's unpack_nibbles)."""
    low = op.Unsqueeze(op.BitwiseAnd(packed, _byte(15)), op.Constant(value_ints=[-1]))
    high = op.Unsqueeze(op.BitShift(packed, _byte(4), direction="RIGHT"), op.Constant(value_ints=[-1]))
    return op.Reshape(op.Concat(low, high, axis=-1), op.Constant(value_ints=[*packed.shape[:-1], -1]))


def like_activations(value, x):
    """A quantized weight's float scales or zero points in x's type (MatMulNBits and QMoE take them so): as they
    are, or widened (float16 scales beside float32 activations; a Cast of a constant, folded when exporting)."""
    if value is None or value.dtype in (x.dtype, onnxscript.ir.DataType.UINT8):
        return value
    return op.CastLike(value, x)


def _zero_points(packed, blocks: int):
    """Packed 4-bit zero points [E, N, ceil(blocks / 2)] -> uint8 [E, N, blocks]."""
    return op.Slice(_nibbles(packed), [0], [blocks], [2])


def _dequantized(qweight, scales, zeros, bits: int, in_features: int):
    """The float [E, N, K] of an expert stack in ir/quant.py's format (the MoE fallback), built from constants."""
    experts, rows, blocks = qweight.shape[0], qweight.shape[1], qweight.shape[2]
    q = op.CastLike(_nibbles(qweight) if bits == 4 else qweight, scales)  # [E, N, blocks, group]
    if zeros is None:
        zero = op.CastLike(op.Constant(value_float=float(2 ** (bits - 1))), scales)
    elif zeros.dtype == onnxscript.ir.DataType.UINT8:
        zero = op.CastLike(_zero_points(zeros, blocks), scales)
    else:
        zero = zeros
    last = op.Constant(value_ints=[-1])
    w = op.Mul(op.Sub(q, op.Unsqueeze(zero, last)), op.Unsqueeze(scales, last))
    w = op.Reshape(w, op.Constant(value_ints=[experts, rows, -1]))
    return op.Slice(w, [0], [in_features], [2])


def _qmoe_runs(up: tuple, down: tuple, hidden: int, intermediate: int, accuracy_level: int) -> tuple[int, int] | None:
    """(bits, block size) when the CPU QMoE computes these experts (see the module docstring), else None."""
    (up_qweight, up_zeros, up_bits), (down_qweight, down_zeros, down_bits) = up, down
    group = up_qweight.shape[3] * 8 // up_bits
    float_zeros = any(z is not None and z.dtype != onnxscript.ir.DataType.UINT8 for z in (up_zeros, down_zeros))
    bits = max(up_bits, down_bits)  # mixed widths run as 8 bits
    if down_qweight.shape[3] * 8 // down_bits != group or float_zeros:
        return None
    per_channel = group not in GROUP_SIZES  # a per-channel group as wide as a row: no QMoE block size
    if per_channel or hidden % group or intermediate % group or (bits == 8 and accuracy_level == 0):
        return None
    return bits, group


def _at_width(qweight, zeros, bits: int, width: int) -> tuple:
    """(qweight, zeros) of an expert stack at `width` bits: as they are, or int4 widened to symmetric int8 of the
    same values (q - zero + 128, no zero points) for a QMoE whose other weights are int8."""
    if bits == width:
        return qweight, zeros
    zero = _byte(8) if zeros is None else op.Unsqueeze(_zero_points(zeros, qweight.shape[2]), [-1])
    return op.Sub(op.Add(_nibbles(qweight), _byte(128)), zero), None


def qmoe_lowering(accuracy_level: int):
    """The qmoe_experts lowering for an accuracy_level (QMoE's, with MatMulNBits' meaning)."""

    def qmoe_experts(
        x,
        expert_ids,
        expert_weights,
        up_qweight,
        up_scales,
        up_zeros,
        b_up,
        up_bits: int,
        down_qweight,
        down_scales,
        down_zeros,
        b_down,
        down_bits: int,
        alpha: float = 1.0,
        beta: float = 0.0,
        limit: float = 0.0,
    ):
        hidden, intermediate, experts = x.shape[-1], up_qweight.shape[1] // 2, up_qweight.shape[0]
        up_scales, up_zeros, down_scales, down_zeros = (
            like_activations(value, x) for value in (up_scales, up_zeros, down_scales, down_zeros)
        )
        up, down = (up_qweight, up_zeros, up_bits), (down_qweight, down_zeros, down_bits)
        runs = _qmoe_runs(up, down, hidden, intermediate, accuracy_level)
        if runs is None:
            w_up = _dequantized(up_qweight, up_scales, up_zeros, up_bits, hidden)
            w_down = _dequantized(down_qweight, down_scales, down_zeros, down_bits, intermediate)
            gate = (alpha, beta, limit)
            return _float_moe(x, expert_ids, expert_weights, (w_up, b_up, w_down, b_down), experts, gate)
        bits, group = runs
        (up_q, up_z), (down_q, down_z) = (_at_width(*side, bits) for side in (up, down))
        flat = [
            op.Reshape(q, op.Constant(value_ints=[experts, rows, -1]))
            for q, rows in ((up_q, 2 * intermediate), (down_q, hidden))
        ]
        logits, weights = _routing(x, expert_ids, expert_weights, experts)
        out = MSFT.QMoE(
            x,
            logits,
            flat[0],
            up_scales,
            b_up,
            flat[1],
            down_scales,
            b_down,
            None,
            None,
            None,
            up_z,
            down_z,
            expert_weight_bits=bits,
            block_size=group,
            accuracy_level=accuracy_level,
            **_gate(expert_ids.shape[1], alpha, beta, limit),
        )
        return _scaled_back(out, weights)

    return qmoe_experts
