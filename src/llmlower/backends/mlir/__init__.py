"""The MLIR backend: a Program's step function exported through torch-mlir as torch, linalg, stablehlo or tosa
MLIR for other MLIR compilers (export.to_mlir), the op set decomposed by its own reference implementations
(ir.decompositions) and the weights kept apart as function arguments; artifact.build writes the module, the
weights (safetensors) and the manifest as an artifact directory, and runtime.executors.mlir JIT-compiles a linalg
one. torch-mlir (the mlir extra) is imported only when exporting."""

from ...step_io import KVLayout
from ..backend import Backend

BACKEND = Backend(
    name="mlir",
    package=__name__,
    layouts={"cpu": KVLayout.SLOTS},
    executors={KVLayout.SLOTS: "mlir:MlirLinalgExecutor"},
    compiler="artifact:build",
    program_executor="program_executor:program_executor",
    summary="MLIR through torch-mlir (torch, linalg, stablehlo or tosa); linalg runs here, JIT-compiled (slow)",
    options=("dialect", "static_dims"),
    check="artifact:check_options",
    kv_cache_dtypes={"cpu": ("int8",)},
    toolkit=("torch_mlir",),
)
