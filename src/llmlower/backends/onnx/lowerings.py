"""ONNX lowerings of the op set, as onnxscript functions for torch.onnx.export's custom_translation_table.

Each is a plain traced function (not @onnxscript.script): it is called with symbolic tensors whose static
shapes it may read, and builds ONNX Runtime contrib nodes where one exists.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxscript
from onnxscript import opset18 as op

from ...ir import (
    ADD_RMS_NORM,
    ATTENTION,
    CAUSAL_CONV1D,
    GATED_DELTA_STEP,
    LATENT_ATTENTION,
    MOE_EXPERTS,
    PAGED_ATTENTION,
    PAGED_QKV_ATTENTION,
    QKV_ATTENTION,
    QLINEAR,
    QMOE_EXPERTS,
    RMS_NORM,
    ROPE,
    SELECTIVE_STEP,
    SILU_MUL,
    SSD_STEP,
)
from . import paged_lowerings, recurrent_lowerings
from .moe_lowerings import like_activations, moe_experts, qmoe_lowering
from .paged_lowerings import attention_extras
from .schemas import ensure_schema

MSFT = onnxscript.values.Opset("com.microsoft", 1)
INT32 = onnxscript.onnx_types.INT32.dtype
INT64_MAX = 9223372036854775807

ensure_schema("com.microsoft", "GroupQueryAttention", outputs=3)  # no output_qk
ensure_schema("com.microsoft", "SkipSimplifiedLayerNormalization")
ensure_schema("com.microsoft", "MatMulNBits")
ensure_schema("com.microsoft", "MatMulIntegerToFloat")
ensure_schema("", "SimplifiedLayerNormalization", outputs=1)  # no inv_std_var


def _heads_first_to_packed(x):
    """[batch, heads, tokens, head_dim] -> [batch, tokens, heads * head_dim] (GroupQueryAttention's layout)."""
    return op.Reshape(op.Transpose(x, perm=[0, 2, 1, 3]), op.Constant(value_ints=[0, 0, -1]))


def _sequence_lengths(past_lens, input_lens):
    """GroupQueryAttention's seqlens_k (each sequence's total length - 1, int32) and total_sequence_length."""
    totals = op.Add(past_lens, input_lens)
    seqlens_k = op.Cast(op.Sub(totals, op.Constant(value_int=1)), to=INT32)
    return seqlens_k, op.Cast(op.ReduceMax(totals, keepdims=0), to=INT32)


def attention(
    q, k, v, k_cache, v_cache, past_lens, input_lens, scale: float, window: int = 0, softcap: float = 0.0, sinks=None,
    alibi_slopes=None, k_scale=None, v_scale=None,
):  # fmt: skip
    """GroupQueryAttention over the kv-heads cache. It takes right-padded prompts with no past, or steps
    in which every sequence brings the same number of tokens (decode). Values with a head size of their own,
    which GroupQueryAttention refuses, take the standard-op decomposition instead. ALiBi is its attention_bias; an
    int8 cache is its PER_CHANNEL quantization. Chunked local attention (window < 0), which it has no attribute
    for, takes the decomposition too."""
    heads, head_dim = q.shape[1], q.shape[3]
    if v.shape[3] != head_dim or window < 0:
        return _decomposed_attention(
            q, k, v, k_cache, v_cache, past_lens, input_lens, scale, window, softcap, sinks, alibi_slopes
        )
    bias = _total_alibi(alibi_slopes, past_lens, input_lens, _arange(q, 2), q)
    tail, attributes = attention_extras(7, softcap, sinks, q, bias, k_scale, v_scale)
    out, k_present, v_present = MSFT.GroupQueryAttention(
        _heads_first_to_packed(q),
        _heads_first_to_packed(k),
        _heads_first_to_packed(v),
        k_cache,
        v_cache,
        *_sequence_lengths(past_lens, input_lens),
        *tail,
        num_heads=heads,
        kv_num_heads=k.shape[1],
        scale=scale,
        local_window_size=window if window > 0 else -1,
        **attributes,
    )
    batch_tokens = op.Shape(out, start=0, end=2)
    shape = op.Concat(batch_tokens, op.Constant(value_ints=[heads, head_dim]), axis=0)
    out = op.Transpose(op.Reshape(out, shape), perm=[0, 2, 1, 3])
    return out, k_present, v_present


def _arange(x, axis: int):
    """0, 1, ... up to x's size along `axis` (int64)."""
    size = op.Squeeze(op.Shape(x, start=axis, end=axis + 1))
    return op.Range(op.Constant(value_int=0), size, op.Constant(value_int=1))


def _written(new, cache, past_lens, input_lens):
    """The cache with each sequence's new tokens at positions past_lens + t (t < input_lens), in standard ops:
    every cache position gathers the new token that lands on it, if any (ir/attention.py's tensorised write)."""
    one = op.Constant(value_ints=[1])
    source = op.Sub(
        op.Unsqueeze(_arange(cache, 2), op.Constant(value_ints=[0])), op.Unsqueeze(past_lens, one)
    )  # [batch, ctx]
    landed = op.And(op.GreaterOrEqual(source, op.Constant(value_int=0)), op.Less(source, op.Unsqueeze(input_lens, one)))
    last = op.Sub(op.Shape(new, start=2, end=3), one)
    index = op.Min(op.Max(source, op.Constant(value_int=0)), last)
    index = op.Expand(op.Unsqueeze(index, op.Constant(value_ints=[1, 3])), op.Shape(cache))
    gathered = op.GatherElements(new, index, axis=2)
    return op.Where(op.Unsqueeze(landed, op.Constant(value_ints=[1, 3])), gathered, cache)


def _repeated(x, heads: int, kv_heads: int, dim: int):
    """[batch, kv_heads, keys, dim] -> [batch, heads, keys, dim], each kv head repeated for its query heads."""
    group = op.Constant(value_ints=[1, 1, heads // kv_heads, 1, 1])
    expanded = op.Expand(op.Unsqueeze(x, op.Constant(value_ints=[2])), group)
    return op.Reshape(expanded, op.Constant(value_ints=[0, heads, -1, dim]))


def _allowed(past_lens, input_lens, tokens, keys, window: int):
    """[batch, 1, tokens, keys]: which cache positions each new token attends to (causal, in its sequence,
    within the window or chunk: ir/attention.py's `visible`)."""
    positions = op.Unsqueeze(_positions(past_lens, tokens), op.Constant(value_ints=[2]))
    allowed = op.And(
        op.LessOrEqual(keys, positions),
        op.Less(keys, op.Unsqueeze(op.Add(past_lens, input_lens), op.Constant(value_ints=[1, 2]))),
    )
    if window > 0:
        allowed = op.And(allowed, op.Greater(keys, op.Sub(positions, op.Constant(value_int=window))))
    elif window < 0:
        start = op.Sub(positions, op.Mod(positions, op.Constant(value_int=-window)))
        allowed = op.And(allowed, op.GreaterOrEqual(keys, start))
    return op.Unsqueeze(allowed, op.Constant(value_ints=[1]))


def _alibi(slopes, keys, positions, like):
    """ALiBi's logits [batch, heads, tokens, keys] in the type of `like`: slopes [heads] times (keys - positions),
    keys [keys] and positions [batch, tokens] int64 (ir/attention.py's alibi_bias)."""
    distance = op.Sub(
        op.Unsqueeze(keys, op.Constant(value_ints=[0, 1])), op.Unsqueeze(positions, op.Constant(value_ints=[2]))
    )
    slopes = op.Reshape(op.CastLike(slopes, like), op.Constant(value_ints=[1, -1, 1, 1]))
    return op.Mul(slopes, op.Unsqueeze(op.CastLike(distance, like), op.Constant(value_ints=[1])))


def _positions(past_lens, tokens):
    """[batch, tokens]: each new token's position, past_lens + t."""
    return op.Add(op.Unsqueeze(past_lens, op.Constant(value_ints=[1])), tokens)


def _total_alibi(slopes, past_lens, input_lens, tokens, like):
    """GroupQueryAttention's attention_bias for ALiBi (None without slopes): over keys 0 .. total_sequence_length - 1,
    the longest sequence's total, the last dimension onnxruntime 1.31's CPU kernel requires."""
    if slopes is None:
        return None
    total = op.ReduceMax(op.Add(past_lens, input_lens), keepdims=0)
    keys = op.Range(op.Constant(value_int=0), total, op.Constant(value_int=1))
    return _alibi(slopes, keys, _positions(past_lens, tokens), like)


def _scalar(value: float, like):
    """A float constant in the type of `like`."""
    return op.CastLike(op.Constant(value_float=value), like)


def _decomposed_attention(
    q, k, v, k_cache, v_cache, past_lens, input_lens, scale, window, softcap, sinks, alibi_slopes
):
    """`attention` in standard ONNX ops (ir/attention.py's `attend` over the written caches)."""
    heads, kv_heads, dk, dv = q.shape[1], k.shape[1], k.shape[3], v.shape[3]
    k_cache, v_cache = _written(k, k_cache, past_lens, input_lens), _written(v, v_cache, past_lens, input_lens)
    allowed = _allowed(past_lens, input_lens, _arange(q, 2), _arange(k_cache, 2), window)
    keys, values = _repeated(k_cache, heads, kv_heads, dk), _repeated(v_cache, heads, kv_heads, dv)
    bias = None
    if alibi_slopes is not None:
        bias = _alibi(alibi_slopes, _arange(k_cache, 2), _positions(past_lens, _arange(q, 2)), q)
    return _attend(q, keys, values, allowed, scale, softcap, sinks, heads, bias), k_cache, v_cache


def _attend(q, keys, values, allowed, scale: float, softcap: float, sinks, heads: int, bias=None):
    """Softmax of the scaled, soft-capped, biased (ALiBi), masked logits with each head's sink as an extra column,
    times the values; keys and values [batch, heads or 1, keys, d] (one head broadcasts to every query head)."""
    scores = op.Mul(op.MatMul(q, op.Transpose(keys, perm=[0, 1, 3, 2])), _scalar(scale, q))
    if softcap:
        cap = _scalar(softcap, q)
        scores = op.Mul(op.Tanh(op.Div(scores, cap)), cap)
    if bias is not None:
        scores = op.Add(scores, bias)
    scores = op.Where(allowed, scores, _scalar(float(np.finfo(np.float32).min), q))
    if sinks is not None:
        column_shape = op.Concat(op.Shape(scores, start=0, end=3), op.Constant(value_ints=[1]), axis=0)
        column = op.Expand(op.Reshape(op.CastLike(sinks, q), op.Constant(value_ints=[1, heads, 1, 1])), column_shape)
        weights = op.Softmax(op.Concat(scores, column, axis=-1), axis=-1)
        weights = op.Slice(
            weights, op.Constant(value_ints=[0]), op.Constant(value_ints=[-1]), op.Constant(value_ints=[3])
        )
    else:
        weights = op.Softmax(scores, axis=-1)
    return op.MatMul(weights, values)


def _narrow(x, start: int, end: int = INT64_MAX, axis: int = 3):
    """x[start:end] along `axis` (the last of a 4-d tensor by default)."""
    return op.Slice(x, op.Constant(value_ints=[start]), op.Constant(value_ints=[end]), op.Constant(value_ints=[axis]))


def latent_attention(q, latent, k_pe, kv_weight, c_cache, pe_cache, past_lens, input_lens, scale: float, window=0):
    """ir/latent_attention.py in standard ONNX ops: q's non-rotary part absorbed into the latent space through
    kv_weight's key rows (one MatMul per step), attention with one kv head over [latent, k_pe] with the latent
    as values, then kv_weight's value rows."""
    heads, rank, nope = q.shape[1], latent.shape[3], q.shape[3] - k_pe.shape[3]
    weight = op.Reshape(kv_weight, op.Constant(value_ints=[heads, -1, rank]))  # [heads, nope + dv, rank]
    key_weight, value_weight = _narrow(weight, 0, nope, 1), _narrow(weight, nope, axis=1)
    query = op.Concat(op.MatMul(_narrow(q, 0, nope), key_weight), _narrow(q, nope), axis=-1)
    c_cache = _written(latent, c_cache, past_lens, input_lens)
    pe_cache = _written(k_pe, pe_cache, past_lens, input_lens)
    allowed = _allowed(past_lens, input_lens, _arange(q, 2), _arange(c_cache, 2), window)
    out = _attend(query, op.Concat(c_cache, pe_cache, axis=-1), c_cache, allowed, scale, 0.0, None, heads)
    return op.MatMul(out, op.Transpose(value_weight, perm=[0, 2, 1])), c_cache, pe_cache


def qkv_attention(
    qkv,
    k_cache,
    v_cache,
    past_lens,
    input_lens,
    cos_table,
    sin_table,
    heads: int,
    kv_heads: int,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    sinks=None,
    alibi_slopes=None,
    k_scale=None,
    v_scale=None,
):
    """One GroupQueryAttention on the packed projection, rotating q and k itself (do_rotary): it derives each
    token's position from the sequence lengths as the op does (past_lens + t)."""
    bias = _total_alibi(alibi_slopes, past_lens, input_lens, _arange(qkv, 1), qkv)
    tail, attributes = attention_extras(9, softcap, sinks, qkv, bias, k_scale, v_scale)
    return MSFT.GroupQueryAttention(
        qkv,
        None,
        None,
        k_cache,
        v_cache,
        *_sequence_lengths(past_lens, input_lens),
        cos_table,
        sin_table,
        *tail,
        num_heads=heads,
        kv_num_heads=kv_heads,
        scale=scale,
        local_window_size=window if window > 0 else -1,
        do_rotary=1,
        **attributes,
    )


def rms_norm(x, weight, eps: float):
    return op.SimplifiedLayerNormalization(x, weight, axis=-1, epsilon=eps)


def add_rms_norm(x, residual, weight, eps: float):
    """SkipSimplifiedLayerNormalization, which takes 2-D or 3-D inputs only: a sum of more dimensions (a per-head
    q/k norm after rotary, HunYuan's) is normed as rows [-1, hidden] and shaped back."""
    if len(x.shape) <= 3:
        normed, _, _, total = MSFT.SkipSimplifiedLayerNormalization(x, residual, weight, epsilon=eps)
        return normed, total
    shape, rows = op.Shape(x), op.Constant(value_ints=[-1, x.shape[-1]])
    normed, _, _, total = MSFT.SkipSimplifiedLayerNormalization(
        op.Reshape(x, rows), op.Reshape(residual, rows), weight, epsilon=eps
    )
    return op.Reshape(normed, shape), op.Reshape(total, shape)


def rope(x, cos, sin):
    half = x.shape[-1] // 2
    first = op.Slice(x, op.Constant(value_ints=[0]), op.Constant(value_ints=[half]), op.Constant(value_ints=[-1]))
    second = op.Slice(
        x, op.Constant(value_ints=[half]), op.Constant(value_ints=[INT64_MAX]), op.Constant(value_ints=[-1])
    )
    rotated = op.Concat(op.Neg(second), first, axis=-1)
    return op.Add(op.Mul(x, cos), op.Mul(rotated, sin))


def silu_mul(x):
    gate, up = op.Split(x, axis=-1, num_outputs=2)
    return op.Mul(op.Mul(gate, op.Sigmoid(gate)), up)


def _group_sums(x, blocks: int, group: int, in_features: int):
    """x [..., K] -> sums over each quantization group [..., blocks]: one MatMul by a constant 0/1 matrix [K, blocks]
    (a single node; Pad + Reshape + ReduceSum cost three dispatches per linear, ~1.5 ms of a SmolLM2 token)."""
    indicator = np.zeros((in_features, blocks), dtype=np.float32)
    indicator[np.arange(in_features), np.arange(in_features) // group] = 1.0
    return op.MatMul(x, op.CastLike(op.Constant(value=onnx.numpy_helper.from_array(indicator)), x))


def qlinear_lowering(accuracy_level: int):
    """The qlinear lowering for a MatMulNBits accuracy_level: 0 computes in float32; 4 quantizes activations
    to int8 per block, MLAS' fast path on CPU (SmolLM2 q4g32 decode: 47 tokens/s against 5.5 with float zero
    points taken directly)."""

    def qlinear(x, qweight, scales, zeros, bias, bits: int, in_features: int):
        return _qlinear(x, qweight, scales, zeros, bias, bits, in_features, accuracy_level)

    return qlinear


def _per_channel_int8(x, qweight, scales, in_features: int, accuracy_level: int):
    """x times an int8 weight with one scale per output channel. At accuracy level 4 on float32, x is quantized
    per row (symmetric: uint8 around 128) and MLAS' integer GEMM multiplies the stored bytes with their zero point
    128 (MatMulIntegerToFloat applies the weight's scales, a Mul the row's): 2-4x MatMulNBits' 8-bit rate at 16-100
    rows on AVX2. uint8 x uint8, because AVX2's uint8 x int8 multiply-add (vpmaddubsw) saturates a pair's sum at
    32,767, which 255 x 127 x 2 passes. Otherwise the weight is dequantized to a float MatMul's (folded once when
    the session loads)."""
    out_features = qweight.shape[0]
    stored = op.Reshape(qweight, op.Constant(value_ints=[out_features, in_features]))
    if accuracy_level == 0 or x.dtype != onnxscript.ir.DataType.FLOAT:
        weight = op.Mul(op.Sub(op.CastLike(stored, scales), _scalar(128.0, scales)), scales)  # scales: [N, 1]
        return op.MatMul(x, op.Transpose(weight, perm=[1, 0]))
    row_scales = op.Max(
        op.Mul(op.ReduceMax(op.Abs(x), op.Constant(value_ints=[-1]), keepdims=1), _scalar(1 / 127, x)),
        _scalar(1e-30, x),
    )
    one, middle = op.Constant(value_float=1.0), op.Constant(value=onnx.numpy_helper.from_array(np.uint8(128)))
    rows = op.QuantizeLinear(op.Div(x, row_scales), one, middle)
    weight = op.Transpose(stored, perm=[1, 0])  # [K, N]: folded when the session loads
    column_scales = op.Reshape(scales, op.Constant(value_ints=[-1]))
    return op.Mul(MSFT.MatMulIntegerToFloat(rows, weight, one, column_scales, middle, middle), row_scales)


def _qlinear(x, qweight, scales, zeros, bias, bits: int, in_features: int, accuracy_level: int):
    """MatMulNBits on the packed tensors as they are. Float zero points take MLAS' slow path (16x slower
    than packed ones on this CPU), so (q - z) s is split into (q - 8) s, a symmetric MatMulNBits, plus
    (8 - z) s times each group's sum of x: a [.., blocks] x [blocks, N] matmul. int8 with one group per row
    (per channel) takes the integer GEMM instead (_per_channel_int8)."""
    out_features, blocks = qweight.shape[0], qweight.shape[1]
    scales, zeros = like_activations(scales, x), like_activations(zeros, x)
    if bits == 8 and blocks == 1 and qweight.shape[2] == in_features:  # one unpadded group per row
        y = _per_channel_int8(x, qweight, scales, in_features, accuracy_level)
        return y if bias is None else op.Add(y, bias)
    group = qweight.shape[2] * 8 // bits
    flat = op.Constant(value_ints=[-1])
    inputs = [x, qweight, op.Reshape(scales, flat)]
    packed_zeros = zeros is not None and zeros.dtype == onnxscript.ir.DataType.UINT8
    if packed_zeros:
        inputs.append(op.Reshape(zeros, flat))
    y = MSFT.MatMulNBits(
        *inputs, K=in_features, N=out_features, bits=bits, block_size=group, accuracy_level=accuracy_level
    )
    if zeros is not None and not packed_zeros:
        offsets = op.Mul(op.Sub(op.CastLike(op.Constant(value_float=8.0), zeros), zeros), scales)  # [N, blocks]
        y = op.Add(y, op.MatMul(_group_sums(x, blocks, group, in_features), op.Transpose(offsets, perm=[1, 0])))
    return y if bias is None else op.Add(y, bias)


def translations(accuracy_level: int = 4) -> dict:
    """torch op -> onnxscript lowering, for torch.onnx.export's custom_translation_table."""
    return {
        ATTENTION.overload: attention,
        LATENT_ATTENTION.overload: latent_attention,
        QKV_ATTENTION.overload: qkv_attention,
        PAGED_ATTENTION.overload: paged_lowerings.paged_attention,
        PAGED_QKV_ATTENTION.overload: paged_lowerings.paged_qkv_attention,
        RMS_NORM.overload: rms_norm,
        ADD_RMS_NORM.overload: add_rms_norm,
        ROPE.overload: rope,
        SILU_MUL.overload: silu_mul,
        MOE_EXPERTS.overload: moe_experts,
        QLINEAR.overload: qlinear_lowering(accuracy_level),
        QMOE_EXPERTS.overload: qmoe_lowering(accuracy_level),
        CAUSAL_CONV1D.overload: recurrent_lowerings.causal_conv1d,
        GATED_DELTA_STEP.overload: recurrent_lowerings.gated_delta_step,
        SSD_STEP.overload: recurrent_lowerings.ssd_step,
        SELECTIVE_STEP.overload: recurrent_lowerings.selective_step,
    }
