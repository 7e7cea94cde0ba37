"""ONNX lowerings of the recurrent ops of hybrid models, in standard ops (ONNX Runtime has no contrib op for them on
the CPU): the step's state is an input and an output of the graph, as the KV cache is."""

from __future__ import annotations

import numpy as np
import onnx
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
