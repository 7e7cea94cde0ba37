"""Step times on a backend: the backends table (backends.registry) says how each builds an executor for a
Program and which KV layout its programs use; steps are timed repeatedly. ONNX Runtime runs one intra-op thread
per logical core, as benchmarks/speed.py does (its default, one per physical core, ran SmolLM2 steps 2-2.5x
slower on the 2-vCPU VM)."""

from __future__ import annotations

import copy
import os
import time
from collections.abc import Sequence
from pathlib import Path

from ..backends.registry import get_backend
from ..errors import LlmlowerError
from ..ir.program import Program
from ..passes import run_pipeline, with_kv_layout
from ..passes.manager import PassSpec
from ..runtime.executor import Executor, StepBatch, sequential_block_tables
from ..step_io import KVLayout
from .shapes import Step


def check_backend(backend: str) -> None:
    """Fail unless `backend` is registered and its package imports in this build."""
    entry = get_backend(backend)
    try:
        entry.load(entry.program_executor)
    except ImportError:
        raise LlmlowerError(f"--backend {backend}: the {backend} backend is not available in this build") from None


def timed_program(backend: str, captured: Program, passes: Sequence[PassSpec]) -> Program:
    """The program the backend runs for a pipeline: the pipeline adapted to the backend's CPU KV layout."""
    layout = get_backend(backend).layout("cpu")
    return run_pipeline(copy.deepcopy(captured), with_kv_layout(passes, layout))


def build_executor(backend: str, program: Program, max_batch: int, max_context: int) -> Executor:
    """The executor `backend` builds for `program`, with KV room for max_batch sequences of max_context tokens."""
    check_backend(backend)
    block_size = program.block_size if program.kv_layout is KVLayout.PAGED else 16
    num_blocks = max_batch * -(-max_context // block_size)
    entry = get_backend(backend)
    return entry.load(entry.program_executor)(program, max_context, num_blocks)


def artifact_executor(artifact: Path, max_batch: int, max_context: int) -> Executor:
    """The executor of a compiled artifact, as Engine.load builds it."""
    from ..runtime import Engine

    threads = os.cpu_count() or 0
    return Engine.load(artifact, max_num_seqs=max_batch, max_context=max_context, threads=threads).executor


def step_batch(executor: Executor, step: Step) -> StepBatch:
    """The executor batch for `step`: sequences 0..batch-1, `tokens` new tokens each after `past` cached ones."""
    tables = sequential_block_tables(executor, [step.context] * step.batch)
    return StepBatch([[1] * step.tokens] * step.batch, [step.past] * step.batch, tables)


def time_step(executor: Executor, step: Step, repeats: int) -> list[float]:
    """Seconds of `repeats` runs of `step`, after one warm-up run; the `past` tokens are prefilled first."""
    if step.past:
        tables = sequential_block_tables(executor, [step.context] * step.batch)
        executor.step(StepBatch([[1] * step.past] * step.batch, [0] * step.batch, tables))
    batch = step_batch(executor, step)
    executor.step(batch)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        executor.step(batch)
        times.append(time.perf_counter() - started)
    return times
