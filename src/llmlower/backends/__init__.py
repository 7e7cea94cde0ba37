"""Backends: Program -> something that runs (the torch reference, ONNX Runtime, TVM) or that other compilers
take (MLIR through torch-mlir). Each is a package whose `BACKEND` (backend.Backend) declares it, registered by
one line in registry.BACKEND_PACKAGES."""
