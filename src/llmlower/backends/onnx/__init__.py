"""The ONNX Runtime backend: lower a Program to ONNX (com.microsoft GroupQueryAttention, MatMulNBits,
(Skip)SimplifiedLayerNormalization) and run it with runtime.executors.onnx.OnnxExecutor; artifact.build
writes it as a deployable artifact directory."""

from .export import LoweringError, check_lowerable, to_onnx

__all__ = ["LoweringError", "check_lowerable", "to_onnx"]
