"""torch-mlir's MLIR context with every dialect the mlir backend emits registered (torch, stablehlo and upstream
MLIR's): for parsing, lowering and running modules. Imports no torch (a runtime may use it)."""

from __future__ import annotations

from typing import Any


def mlir_context() -> Any:
    """A fresh torch_mlir.ir.Context that parses torch, linalg, stablehlo and tosa modules."""
    from torch_mlir import ir
    from torch_mlir._mlir_libs import _stablehlo
    from torch_mlir.dialects import torch as torch_dialect

    context = ir.Context()
    torch_dialect.register_dialect(context)
    _stablehlo.register_dialect(context)
    return context
