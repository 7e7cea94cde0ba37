"""torch-mlir's MLIR context, and linalg-on-tensors functions compiled for this CPU with torch-mlir's own passes
and MLIR's execution engine, as torch-mlir's reference backend does (bufferize, loops, LLVM, JIT): scalar loops,
slow, but what the mlir backend emits, run as it is. Needs numpy and torch-mlir only (no torch)."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import LlmlowerError

# torch-mlir's reference backend pipeline (torch_mlir_e2e_test/linalg_on_tensors_backends/refbackend.py): the
# function's results come back through a callback (refback-munge-calling-conventions), one per result signature.
# Unlike refback, no sparse tensor passes (the modules have none; their bufferization refuses the loops of the
# recurrent ops, whose carried tensors are reallocated, which allow-return-allocs-from-loops permits), and the
# deallocation pipeline runs on the module, where it may add the helper function a loop's buffers need.
LOWERING = (
    "func.func(linalg-generalize-named-ops)",
    "func.func(linalg-fuse-elementwise-ops)",
    "convert-shape-to-std",
    "func.func(expand-realloc)",
    "func.func(refback-generalize-tensor-pad)",
    "func.func(refback-generalize-tensor-concat)",
    "func.func(tm-tensor-bufferize)",
    "one-shot-bufferize{allow-return-allocs-from-loops copy-before-write bufferize-function-boundaries "
    "function-boundary-type-conversion=identity-layout-map}",
    "refback-mlprogram-bufferize",
    "buffer-deallocation-pipeline",
    "inline",
    "refback-munge-calling-conventions",
    "func.func(tm-tensor-to-loops)",
    "func.func(refback-munge-memref-copy)",
    "func.func(convert-linalg-to-loops)",
    "func.func(lower-affine)",
    "convert-scf-to-cf",
)
# refback's own pipeline starts with refback-expand-ops-for-llvm, which rewrites tanh as (e^2x - 1) / (e^2x + 1):
# 6e-6 relative error near 0 (measured on x ~ N(0, 9)) where libm's tanhf, called here instead, gives 2e-7
TO_LLVM = (
    "func.func(arith-expand)",
    "func.func(convert-math-to-llvm)",
    "convert-math-to-libm",
    "expand-strided-metadata",
    "finalize-memref-to-llvm",
    "lower-affine",
    "convert-scf-to-cf",
    "convert-bufferization-to-memref",
    "finalize-memref-to-llvm",
    "func.func(convert-arith-to-llvm)",
    "convert-vector-to-llvm",
    "convert-func-to-llvm",
    "convert-cf-to-llvm",
    "convert-complex-to-llvm",
    "reconcile-unrealized-casts",
)
RETURN_PREFIX = "refbackend_consume_func_return_"
RESULT_DTYPES = {
    "mrf16": np.float16,
    "mrf32": np.float32,
    "mrf64": np.float64,
    "mri1": np.bool_,
    "mri8": np.int8,
    "mri32": np.int32,
    "mri64": np.int64,
}


OPT_LEVEL_VARIABLE = "LLMLOWER_MLIR_OPT_LEVEL"
# LLVM's optimization level for the JIT when the caller gives none. A tiny test model's step function: 11 s to
# compile at 2 (most of it LLVM's optimizer, on the load and on the first call), 2 s at 0, where its loops then run
# about 1.7x slower; at SmolLM2's size the loops are the time, so 2 is the default and the test suite runs at 0.
DEFAULT_OPT_LEVEL = 2


def jit_opt_level() -> int:
    """The JIT's optimization level: $LLMLOWER_MLIR_OPT_LEVEL (0 to 3), else DEFAULT_OPT_LEVEL."""
    value = os.environ.get(OPT_LEVEL_VARIABLE, str(DEFAULT_OPT_LEVEL))
    if value not in ("0", "1", "2", "3"):
        raise LlmlowerError(f"{OPT_LEVEL_VARIABLE}={value!r}: expected 0, 1, 2 or 3")
    return int(value)


def mlir_context() -> Any:
    """A fresh torch_mlir.ir.Context that parses torch, linalg, stablehlo and tosa modules."""
    from torch_mlir import ir
    from torch_mlir._mlir_libs import _stablehlo
    from torch_mlir.dialects import torch as torch_dialect

    context = ir.Context()
    torch_dialect.register_dialect(context)
    _stablehlo.register_dialect(context)
    return context


class LinalgFunction:
    """A function of a linalg-on-tensors module compiled for this CPU; called with numpy arrays (its arguments in
    order), it returns its results as numpy arrays. `bound`: trailing arguments the same in every call (the
    weights), passed after the call's own; their memref descriptors are made once, not per call (making SmolLM2's
    272 took 14 ms a call; its decode step takes about 130 ms). `verify` adds MLIR's runtime checks (out-of-bounds
    accesses abort the process with the op at fault); `opt_level`: LLVM's, jit_opt_level() when None."""

    def __init__(
        self,
        text: str,
        function: str = "step",
        bound: Sequence[np.ndarray] = (),
        opt_level: int | None = None,
        verify: bool = False,
    ) -> None:
        from torch_mlir import ir
        from torch_mlir.execution_engine import ExecutionEngine
        from torch_mlir.passmanager import PassManager
        from torch_mlir.runtime import UnrankedMemRefDescriptor, unranked_memref_to_numpy

        context = mlir_context()
        module = ir.Module.parse(text, context)
        passes = (*LOWERING, *(("generate-runtime-verification",) if verify else ()), *TO_LLVM)
        try:
            with context:
                PassManager.parse(f"builtin.module({','.join(passes)})").run(module.operation)
        except Exception as error:
            raise LlmlowerError(f"the linalg module does not compile to LLVM: {error}") from None
        self.function = function
        self._bound_arrays = [np.ascontiguousarray(a) for a in bound]  # the memory the descriptors point into
        self._bound = [_descriptor(a) for a in self._bound_arrays]
        self.engine = ExecutionEngine(module, opt_level=jit_opt_level() if opt_level is None else opt_level)
        self._results: list[np.ndarray] | None = None
        self._callbacks = []  # kept alive as long as the engine may call them
        for op in module.body.operations:
            name = str(op.attributes["sym_name"]).strip('"') if "sym_name" in op.attributes else ""
            if not name.startswith(RETURN_PREFIX):
                continue
            kinds = name.removeprefix(RETURN_PREFIX).split("_")
            signature = ctypes.CFUNCTYPE(None, *[ctypes.POINTER(UnrankedMemRefDescriptor)] * len(kinds))

            def consume(*memrefs: Any, kinds: list[str] = kinds) -> None:
                self._results = [
                    unranked_memref_to_numpy(m, RESULT_DTYPES[k]).copy() for m, k in zip(memrefs, kinds, strict=True)
                ]

            callback = signature(consume)
            self._callbacks.append(callback)
            self.engine.register_runtime(name, callback)

    def __call__(self, *arrays: np.ndarray) -> list[np.ndarray]:
        contiguous = [np.ascontiguousarray(a) for a in arrays]  # alive until the call returns
        self._results = None
        self.engine.invoke(self.function, *[_descriptor(a) for a in contiguous], *self._bound)
        results, self._results = self._results, None
        if results is None:
            raise LlmlowerError(f"@{self.function} returned nothing")
        return results


def _descriptor(array: np.ndarray) -> Any:
    """The argument the execution engine takes for a contiguous numpy array (a pointer to its memref pointer)."""
    from torch_mlir.runtime import get_unranked_memref_descriptor

    return ctypes.pointer(ctypes.pointer(get_unranked_memref_descriptor(array)))
