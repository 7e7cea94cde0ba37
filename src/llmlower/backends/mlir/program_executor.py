"""An MLIR executor straight from a Program (no artifact), for tests and the roofline study: the program exported
to linalg (export.to_mlir) and JIT-compiled for this CPU, its weights passed as the function's arguments."""

from __future__ import annotations

from ...ir.program import Program
from ...progress import stage
from ...runtime.executors.mlir import MlirLinalgExecutor
from .export import to_mlir


def program_executor(program: Program, max_context: int, num_blocks: int | None = None) -> MlirLinalgExecutor:
    """The backends table's entry: `program` (a SLOTS program) lowered to linalg and run by MLIR's engine."""
    with stage("export to linalg (torch-mlir)"):
        module = to_mlir(program, "linalg")
    with stage("compile the linalg module for this CPU (MLIR's execution engine)"):
        return MlirLinalgExecutor(
            module.text,
            [t.to_dict() for t in module.inputs],
            [t.to_dict() for t in module.outputs],
            [w.detach().contiguous().numpy() for w in module.weights.values()],
            min(max_context, program.spec.max_positions),
            num_blocks,
        )
