"""Executors that need only their backend's runtime library (no torch), and how an artifact names its own."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from ..artifact import MANIFEST, ArtifactError
from ..executor import Executor

# backend name in manifest.json -> "module:class" of its executor (imported only when used)
EXECUTORS = {"onnx": "onnx:OnnxExecutor", "tvm": "tvm:TvmExecutor"}


def load_executor(
    artifact: Path, manifest: dict[str, Any], max_batch: int, max_context: int, threads: int = 0
) -> Executor:
    """The executor of the artifact's backend, loaded from the artifact's files."""
    backend = manifest.get("backend")
    if backend not in EXECUTORS:
        raise ArtifactError(f"{artifact / MANIFEST}: backend {backend!r} has no executor here")
    module, name = EXECUTORS[backend].split(":")
    executor_class = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    return executor_class.from_artifact(artifact, manifest, max_batch, max_context, threads)
