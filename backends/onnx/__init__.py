"""The ONNX Runtime backend: lower a Program to ONNX (com.microsoft GroupQueryAttention, MatMulNBits,
(Skip)SimplifiedLayerNormalization) and run it with runtime.executors.onnx.OnnxExecutor.

Work in progress toward the artifact format and `llmlower compile` (issue 4): the model is built in
memory; IO binding, artifacts and the CUDA EP are not here yet."""

from .export import LoweringError, check_lowerable, to_onnx

__all__ = ["LoweringError", "check_lowerable", "to_onnx"]
