"""Backends: Program -> something that runs (the torch reference, ONNX Runtime, TVM) or that other compilers
take (MLIR through torch-mlir); runtime.backends registers each."""
