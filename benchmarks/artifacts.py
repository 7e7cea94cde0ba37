"""Artifacts the benchmarks compile once and reuse: compiled again only when the backend, its KV layout, the passes
or their options differ from what the directory holds, when the compiler's source changed since (a stamp beside
the directory holds its digest: a kernel changed between commits of an editable install keeps the version), or
when asked to. They compile in a child process: a TVM compile in the process that then measures left its batch-1
decode slower for the rest of that process (SmolLM2 q4mix-a8, 2 threads: 245-259 tok/s against 276-290 for the same
artifact loaded by a fresh process; no thread of the compile kept running, and the cause is not known)."""

from __future__ import annotations

import json
import multiprocessing
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from llmlower.api import compile_artifact, with_kv_cache_dtype
from llmlower.backends.registry import get_backend
from llmlower.compile_cache import compiler_source_digest
from llmlower.passes import build_pipeline, with_kv_layout
from llmlower.runtime.artifact import FORMAT_VERSION


def ensure_artifact(
    model: str,
    backend: str,
    options: dict[str, Any],
    directory: Path,
    rebuild: bool = False,
    draft_layers: tuple[int, ...] = (),
    kv_cache_dtype: str = "auto",
    compile_options: dict[str, Any] | None = None,
) -> Path:
    """`directory` holding MODEL compiled by `backend` (for the CPU) with build_pipeline(**options), its KV cache
    in `kv_cache_dtype`, the self-drafts of `draft_layers` layers and the backend's `compile_options` (tvm's cpu:
    an LLVM CPU name, for a build without AVX-512 or AMX)."""
    pipeline = build_pipeline(**options)
    layout = get_backend(backend).layout("cpu")
    manifest_path = directory / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    # what compile_artifact runs: the pipeline with the passes of the backend's KV layout (paged: paged_attention)
    # and of the cache's dtype; calibrated passes' token ids are left out of the comparison (compile fills them)
    wanted = [
        _uncalibrated(p, {}) if isinstance(p, str) else _uncalibrated(*p)
        for p in with_kv_cache_dtype(with_kv_layout(pipeline, layout), kv_cache_dtype, "float32")
    ]
    built = [_uncalibrated(p["name"], p["options"]) for p in manifest.get("pipeline", [])]
    same = manifest.get("backend") == backend and manifest.get("kv_layout", {}).get("kind") == layout.value
    same = same and manifest.get("format_version") == FORMAT_VERSION
    stamp = directory.with_name(f"{directory.name}.compiler-source")
    digest = compiler_source_digest() + (json.dumps(compile_options, sort_keys=True) if compile_options else "")
    same = same and stamp.is_file() and stamp.read_text() == digest
    drafts = sorted(d["layers"] for d in manifest.get("drafts", {}).values())
    if rebuild or not same or built != wanted or drafts != sorted(draft_layers):
        print(f"[benchmarks] compiling {backend} {options or 'fp32'} into {directory}", file=sys.stderr)
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as child:
            options = {"backend": backend, "draft_layers": list(draft_layers), "kv_cache_dtype": kv_cache_dtype}
            options |= compile_options or {}
            child.submit(compile_artifact, model, directory, pipeline, **options).result()
        stamp.write_text(digest)
    return directory


def _uncalibrated(name: str, options: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """A pass and its options without the calibration token ids."""
    return name, {key: value for key, value in options.items() if key != "calibration"}
