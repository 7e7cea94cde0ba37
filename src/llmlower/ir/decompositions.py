"""The op set as aten ops: each op's reference implementation, where it traces, is its decomposition. A backend
with no lowering of its own for an op (mlir) reaches the math the torch reference runs, with no second copy."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .registry import OPS


def decomposition_table() -> dict[torch._ops.OpOverload, Callable[..., Any]]:
    """Op overload -> its reference implementation, for every op of the set whose reference traces; for
    `ExportedProgram.run_decompositions` (an op's reference calling another op of the set decomposes that one too)."""
    return {opdef.overload: opdef.reference for opdef in OPS.values() if opdef.reference is not None}
