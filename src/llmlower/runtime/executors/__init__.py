"""Executors that need only their backend's runtime library (no torch); an artifact's manifest names its
backend and KV layout, and runtime.backends says which executor runs them."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ...errors import ArgumentError
from ...step_io import KVLayout
from ..artifact import MANIFEST, ArtifactError
from ..backends import BACKENDS, load_symbol
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
    """The executor of the artifact's backend and KV layout, loaded from the artifact's files (its weights from
    `weights`), with a KV pool of num_blocks blocks of block_size positions and sequences of up to max_context
    tokens; `threads` intra-op threads (0: the backend's default, one per core; more than this machine's CPUs
    is refused: each thread is created, and thousands of them exhaust memory)."""
    cpus = os.cpu_count() or 1
    if isinstance(threads, bool) or not isinstance(threads, int) or not 0 <= threads <= cpus:
        raise ArgumentError(f"--threads {threads!r}: expected 0 (one per core) to {cpus} (this machine's CPUs)")
    executor_class = executor_of(artifact, manifest)
    return executor_class.from_artifact(artifact, manifest, num_blocks, block_size, max_context, threads, weights)


def executor_of(artifact: Path, manifest: dict[str, Any]) -> type[Executor]:
    """The executor class runtime.backends names for the artifact's backend and KV layout (not yet loaded)."""
    backend = BACKENDS.get(manifest.get("backend"))
    layout = manifest.get("kv_layout", {}).get("kind")
    try:
        reference = backend.executors[KVLayout(layout)]
    except (AttributeError, KeyError, ValueError):
        raise ArtifactError(
            f"{artifact / MANIFEST}: backend {manifest.get('backend')!r} with KV layout {layout!r} has no executor here"
        ) from None
    return load_symbol(reference, __name__)
