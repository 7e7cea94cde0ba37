"""Backends: Program -> something that runs (torch reference today; ONNX Runtime and TVM to come)."""
