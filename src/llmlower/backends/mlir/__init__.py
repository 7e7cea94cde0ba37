"""The MLIR backend: a Program's step function exported through torch-mlir as torch, linalg, stablehlo or tosa
MLIR for other MLIR compilers, the op set decomposed by its own reference implementations (ir.decompositions) and
the weights kept apart as function arguments; artifact.build writes the module, the weights (safetensors) and
the manifest as an artifact directory. torch-mlir (the mlir extra) is imported only when exporting."""

from .export import DIALECTS, MlirLoweringError, MlirModule, check_lowerable, lower, to_mlir, torch_module

__all__ = ["DIALECTS", "MlirLoweringError", "MlirModule", "check_lowerable", "lower", "to_mlir", "torch_module"]
