"""A TvmExecutor straight from a Program (no artifact): lower, compile for this CPU and load, for tests and the
roofline study (the backends table's `program_executor`)."""

from __future__ import annotations

import tempfile
from pathlib import Path

from ...ir.program import LOGITS, Program
from ...progress import stage
from ...runtime.executors.tvm import TvmExecutor, pool_shapes
from ...step_io import DEFAULT_SEQUENCES
from .compile import compile_module, tvm_target
from .relax_import import to_relax


def program_executor(
    program: Program, max_context: int, num_blocks: int | None = None, threads: int = 0, accuracy_level: int = 0
) -> TvmExecutor:
    """Compile the PAGED `program` for this machine's CPU and run it with a pool of `num_blocks` KV blocks
    (default: DEFAULT_SEQUENCES sequences of max_context); `accuracy_level` as the artifact's option, but float32
    (0) by default: the reference's own products."""
    target = tvm_target("cpu")
    with stage("lower to Relax and compile with TVM"):
        model = to_relax(program, target, accuracy_level)
        executable = compile_module(model.module, target)
    spec = program.spec
    block_size = program.block_size
    max_context = min(max_context, spec.max_positions)
    all_positions = program.outputs[program.output_names.index(LOGITS)].shape[1] == "tokens"
    with tempfile.TemporaryDirectory() as directory:  # the loaded library stays mapped once the file is gone
        library = str(Path(directory) / "model.so")
        executable.export_library(library)
        return TvmExecutor(
            library,
            model.params,
            model.inputs,
            pools=pool_shapes([t.to_dict() for t in program.inputs]),
            dtype=spec.dtype,
            block_size=block_size,
            num_blocks=num_blocks or DEFAULT_SEQUENCES * -(-max_context // block_size),
            max_context=max_context,
            all_positions=all_positions,
            threads=threads,
        )
