"""A TvmExecutor straight from a Program (no artifact): lower, compile for this CPU and load, for tests and the
roofline study."""

from __future__ import annotations

import tempfile
from pathlib import Path

from ...ir.program import LOGITS, Program
from ...progress import stage
from ...runtime.executors.tvm import TvmExecutor
from .compile import compile_module, tvm_target
from .relax_import import to_relax


def cpu_executor(program: Program, max_batch: int = 4, max_context: int = 2048, threads: int = 0) -> TvmExecutor:
    """Compile `program` for this machine's CPU and run it with a paged KV cache of max_batch x max_context."""
    target = tvm_target("cpu")
    with stage("lower to Relax and compile with TVM"):
        model = to_relax(program, target)
        executable = compile_module(model.module, target)
    all_positions = program.outputs[program.output_names.index(LOGITS)].shape[1] == "tokens"
    with tempfile.TemporaryDirectory() as directory:  # the loaded library stays mapped once the file is gone
        library = str(Path(directory) / "model.so")
        executable.export_library(library)
        return TvmExecutor(
            library,
            model.params,
            model.inputs,
            max_batch=max_batch,
            max_context=max_context,
            all_positions=all_positions,
            threads=threads,
        )
