"""Step times on a backend: one registration per backend (name -> a function that builds its executor for a
Program), and repeated timed steps. ONNX Runtime runs one intra-op thread per logical core, as
benchmarks/speed.py does (its default, one per physical core, ran SmolLM2 steps 2-2.5x slower on the 2-vCPU VM)."""

from __future__ import annotations

import importlib
import os
import time
from collections.abc import Callable
from pathlib import Path

from ..errors import LlmlowerError
from ..ir.program import Program
from ..progress import stage
from ..runtime.executor import Executor, StepBatch
from .shapes import Step

ExecutorBuilder = Callable[[Program, int, int], Executor]  # (program, max_batch, max_context) -> executor


def _torch(program: Program, max_batch: int, max_context: int) -> Executor:
    from ..backends.torch import TorchExecutor

    return TorchExecutor(program, max_batch=max_batch, max_context=max_context)


def _onnx(program: Program, max_batch: int, max_context: int) -> Executor:
    from ..backends.onnx import to_onnx
    from ..runtime.executors.onnx import OnnxExecutor

    with stage("lower to ONNX (torch.onnx.export)"):
        model = to_onnx(program).SerializeToString()
    return OnnxExecutor(model, max_batch=max_batch, max_context=max_context, threads=os.cpu_count() or 0)


def _tvm(program: Program, max_batch: int, max_context: int) -> Executor:
    from ..backends.tvm.executor import cpu_executor

    return cpu_executor(program, max_batch=max_batch, max_context=max_context, threads=os.cpu_count() or 0)


# name -> (the backend's package under llmlower, the function building its executor for a Program)
BACKENDS: dict[str, tuple[str, ExecutorBuilder]] = {
    "torch": ("backends.torch", _torch),
    "onnx": ("backends.onnx", _onnx),
    "tvm": ("backends.tvm", _tvm),
}


def check_backend(backend: str) -> None:
    """Fail unless `backend` is registered and its package imports in this build."""
    if backend not in BACKENDS:
        raise LlmlowerError(f"--backend {backend!r}: expected one of {', '.join(BACKENDS)}")
    try:
        importlib.import_module(f"{__package__.rpartition('.')[0]}.{BACKENDS[backend][0]}")
    except ImportError:
        raise LlmlowerError(f"--backend {backend}: the {backend} backend is not available in this build") from None


def build_executor(backend: str, program: Program, max_batch: int, max_context: int) -> Executor:
    """The executor `backend` builds for `program` (KV cache of max_batch x max_context)."""
    check_backend(backend)
    return BACKENDS[backend][1](program, max_batch, max_context)


def artifact_executor(artifact: Path, max_batch: int, max_context: int) -> Executor:
    """The executor of a compiled artifact, as Engine.load builds it."""
    from ..runtime import Engine

    return Engine.load(artifact, max_batch=max_batch, max_context=max_context, threads=os.cpu_count() or 0).executor


def step_batch(step: Step) -> StepBatch:
    """The executor batch for `step`: slots 0..batch-1, `tokens` new tokens each after `past` cached ones."""
    return StepBatch(list(range(step.batch)), [[1] * step.tokens] * step.batch, [step.past] * step.batch)


def time_step(executor: Executor, step: Step, repeats: int) -> list[float]:
    """Seconds of `repeats` runs of `step`, after one warm-up run; the `past` tokens are prefilled first (a
    paged cache, TVM's, only runs steps over tokens it really holds)."""
    if step.past:
        executor.step(StepBatch(list(range(step.batch)), [[1] * step.past] * step.batch, [0] * step.batch))
    batch = step_batch(step)
    executor.step(batch)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        executor.step(batch)
        times.append(time.perf_counter() - started)
    return times
