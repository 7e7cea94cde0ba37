"""Executors that need only their backend's runtime library (no torch), one module each; an artifact's manifest
names the one that runs it (`executor`: "module:Class"), written there by the backend that compiled it."""

from __future__ import annotations

import importlib
import inspect
import os
import pkgutil
from pathlib import Path
from typing import Any

from ...errors import ArgumentError
from ..artifact import MANIFEST, ArtifactError
from ..executor import Executor
from ..weights import ARTIFACT_WEIGHTS, WeightSource


def load_executor(
    artifact: Path,
    manifest: dict[str, Any],
    num_blocks: int,
    block_size: int,
    max_context: int,
    threads: int = 0,
    weights: WeightSource = ARTIFACT_WEIGHTS,
) -> Executor:
    """The executor the artifact's manifest names (executor_of), loaded from the artifact's files (its weights from
    `weights`), with a KV pool of num_blocks blocks of block_size positions and sequences of up to max_context
    tokens; `threads` intra-op threads (0: the backend's default, one per core; more than this machine's CPUs
    is refused: each thread is created, and thousands of them exhaust memory)."""
    cpus = os.cpu_count() or 1
    if isinstance(threads, bool) or not isinstance(threads, int) or not 0 <= threads <= cpus:
        raise ArgumentError(f"--threads {threads!r}: expected 0 (one per core) to {cpus} (this machine's CPUs)")
    executor_class = executor_of(artifact, manifest)
    return executor_class.from_artifact(artifact, manifest, num_blocks, block_size, max_context, threads, weights)


def executor_of(artifact: Path, manifest: dict[str, Any]) -> type[Executor]:
    """The executor class the manifest's `executor` field names (not yet loaded), checked before anything is
    imported, as an artifact is untrusted input: a module of this package and an Executor class defined there."""
    reference = manifest.get("executor")
    module, _, name = reference.partition(":") if isinstance(reference, str) else ("", "", "")
    modules = sorted(m.name for m in pkgutil.iter_modules(__path__))
    if module not in modules or not name.isidentifier():
        raise ArtifactError(
            f"{artifact / MANIFEST}: field 'executor' {reference!r}: expected \"module:Class\" with the module one "
            f"of llmlower.runtime.executors: {', '.join(modules)}"
        )
    executor_class = getattr(importlib.import_module(f"{__name__}.{module}"), name, None)
    if not (
        isinstance(executor_class, type)
        and issubclass(executor_class, Executor)
        and not inspect.isabstract(executor_class)
        and executor_class.__module__ == f"{__name__}.{module}"
    ):
        raise ArtifactError(f"{artifact / MANIFEST}: field 'executor' {reference!r}: {module} has no executor {name!r}")
    return executor_class
