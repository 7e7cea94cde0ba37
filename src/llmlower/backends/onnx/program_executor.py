"""An ONNX Runtime executor straight from a Program (no artifact), for tests and the roofline study: ONNX Runtime
runs one intra-op thread per logical core, as benchmarks/speed.py does."""

from __future__ import annotations

import os

from ...ir.program import Program
from ...progress import stage
from ...runtime.executors.onnx import OnnxSlotExecutor
from .export import to_onnx


def program_executor(program: Program, max_context: int, num_blocks: int | None = None) -> OnnxSlotExecutor:
    """The backends table's entry: `program` (a SLOTS program) lowered to ONNX and run on the CPU EP."""
    with stage("lower to ONNX (torch.onnx.export)"):
        model = to_onnx(program).SerializeToString()
    return OnnxSlotExecutor(model, max_context, num_blocks, threads=os.cpu_count() or 0)
