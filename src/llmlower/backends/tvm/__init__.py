"""The TVM backend: lower a PAGED Program to Relax (llmlower's paged-attention TIR kernels over block pools the
runtime owns, dequantize-in-matmul for int8/int4 weights), compile it for llvm or CUDA and run it with
runtime.executors.tvm.TvmExecutor; artifact.build writes the library, its weights (safetensors) and the manifest
as a deployable artifact."""

from .compile import check_target, compile_module, tvm_target
from .relax_import import RelaxModel, TvmLoweringError, to_relax

__all__ = ["RelaxModel", "TvmLoweringError", "check_target", "compile_module", "to_relax", "tvm_target"]
