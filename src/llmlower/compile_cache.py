"""The artifact cache behind `llmlower generate MODEL` and `chat MODEL`: a model is compiled once per pipeline,
backend and target into cache_dir()/artifacts and reused while its files and the toolkit stay the same.

An entry is an ordinary artifact directory, written by compile (staged, then renamed into place), named after
the model's path and the CompileRequest, with cache_key.json inside (hashed by the manifest like every file):
the model files' sizes and mtimes, the request, and the toolkit's versions. When the stored key differs (new
weights, another llmlower or onnxruntime) or a file fails its hash on loading, the entry is compiled again in
place. A lock file beside the entry (flock) lets one process compile while others wait, and keeps an entry
from being replaced while another process loads it.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from . import __version__
from .errors import CheckpointError
from .locks import locked
from .runtime.artifact import FORMAT_VERSION, ArtifactError, is_artifact, read_manifest

if TYPE_CHECKING:
    from .passes.manager import PassSpec

KEY_FILE = "cache_key.json"
# __version__ stays the same between commits of an editable install, so the compiler's own source is hashed too
COMPILER_SOURCES = ("api.py", "spec.py", "step_io.py", "frontend", "ir", "passes", "backends")
TOOLKIT_PACKAGES = (
    "torch",
    "transformers",
    "onnx",
    "onnxscript",
    "onnxruntime",
    "onnxruntime-gpu",
    "apache-tvm",
    "torch-mlir",
)

T = TypeVar("T")


@dataclass(frozen=True)
class CompileRequest:
    """What a model is compiled with: the pipeline (as passes.build_pipeline returns it, from `quant`, which
    names the entry), the backend, target and dtype, the KV block size of a paged backend, the self-drafts
    (--speculative self:K) to compile with it, the KV cache's dtype (--kv-cache-dtype) and the recipe these came
    from (recipes.Choice.to_dict(), for the manifest)."""

    pipeline: tuple[PassSpec, ...]
    quant: str
    backend: str
    target: str = "cpu"
    dtype: str | None = None
    block_size: int | None = None
    draft_layers: tuple[int, ...] = ()
    kv_cache_dtype: str = "auto"
    recipe: dict[str, Any] | None = None


def model_files(source: Path) -> dict[str, list[int]]:
    """[size, mtime_ns] of each file the model is read from: the .gguf file, or every file at the top of a
    checkpoint directory. Stat rather than content hashes: hashing would read every weight on every run
    (seconds for SmolLM2's 538 MB, a minute for a 7B model); a rewritten file gets a new mtime."""
    if source.is_file():
        files = [source]
    elif source.is_dir():
        files = sorted(p for p in source.iterdir() if p.is_file())
    else:
        raise CheckpointError(f"{source}: no such file or directory")
    return {p.name: [p.stat().st_size, p.stat().st_mtime_ns] for p in files}


def compiler_source_digest() -> str:
    """sha256 of the compiler's Python source (COMPILER_SOURCES), so that any change to it recompiles."""
    root = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for part in COMPILER_SOURCES:
        for path in sorted((root / part).rglob("*.py")) if (root / part).is_dir() else [root / part]:
            digest.update(f"{path.relative_to(root)}\0".encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def toolkit() -> dict[str, Any]:
    """The versions an artifact depends on: llmlower's (and its compiler's source), the artifact format, and the
    installed packages that capture, lower and run it (None when absent)."""
    versions: dict[str, Any] = {
        "llmlower": __version__,
        "compiler_source": compiler_source_digest(),
        "artifact_format": FORMAT_VERSION,
    }
    for package in TOOLKIT_PACKAGES:
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    return versions


def cache_key(source: Path, request: CompileRequest) -> dict[str, Any]:
    """The key an entry was compiled for, as its cache_key.json reads back (JSON: tuples become lists)."""
    key = {
        "model": str(source.resolve()),
        "compile": {
            "pipeline": request.pipeline,
            "backend": request.backend,
            "target": request.target,
            "dtype": request.dtype,
            "block_size": request.block_size,
            "draft_layers": request.draft_layers,
            "kv_cache_dtype": request.kv_cache_dtype,
            "recipe": request.recipe["recipe"] if request.recipe else None,
        },
        "model_files": model_files(source),
        "toolkit": toolkit(),
    }
    return json.loads(json.dumps(key))


def entry_path(model: str | Path, key: dict[str, Any], request: CompileRequest) -> Path:
    """cache_dir()/artifacts/NAME-QUANT-BACKEND-TARGET-DIGEST: one entry per model path and compile request
    (new weights or a new toolkit replace it rather than adding another)."""
    from .frontend import cache_dir  # the frontend imports torch: only once a model is to be run

    identity = json.dumps([key["model"], key["compile"]], sort_keys=True).encode()
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(str(model)).name or "model")
    label = f"{name}-{request.quant}-{request.backend}-{request.target}-{hashlib.sha256(identity).hexdigest()[:12]}"
    return cache_dir() / "artifacts" / label


def stored_key(entry: Path) -> Any:
    """The key an entry was compiled for; None when it has none or it is unreadable."""
    try:
        return json.loads((entry / KEY_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def why_stale(entry: Path, key: dict[str, Any]) -> str | None:
    """None when `entry` is an intact artifact compiled for `key` (every hash checked); else why it is not."""
    if not entry.exists():
        return "not compiled yet"
    try:
        read_manifest(entry, verify=True)
    except ArtifactError as error:
        return f"damaged: {error}"
    stored = stored_key(entry)
    if not isinstance(stored, dict):
        return f"damaged: {KEY_FILE} is missing or unreadable"
    changed = [field for field in key if stored.get(field) != key[field]]
    return f"{', '.join(changed)} changed" if changed else None


def compile_entry(source: Path, entry: Path, request: CompileRequest, key: dict[str, Any], verify: bool) -> None:
    """Compile into `entry` (replacing what is there), first removing what killed compiles left beside it."""
    from .api import compile_artifact

    for leftover in entry.parent.glob(f".{entry.name}.*"):  # write_artifact's staging and .old directories
        shutil.rmtree(leftover, ignore_errors=True)
    if entry.is_dir() and not is_artifact(entry):  # compile replaces only an artifact
        shutil.rmtree(entry)

    def write_key(directory: Path) -> None:
        (directory / KEY_FILE).write_text(json.dumps(key, indent=2), encoding="utf-8")

    compile_artifact(
        source,
        entry,
        list(request.pipeline),
        backend=request.backend,
        target=request.target,
        dtype=request.dtype,
        block_size=request.block_size,
        verify=verify,
        check_artifact=True,  # a wrong artifact is refused before it is cached, not run silently
        write_extra=write_key,
        draft_layers=list(request.draft_layers),
        kv_cache_dtype=request.kv_cache_dtype,
        recipe=request.recipe,
    )


def compile_time(manifest: dict[str, Any], seconds: float) -> str:
    """How a compile's `seconds` were spent, from its manifest's pipeline: the calibrated passes (and which read
    their results from the calibration store), the other passes, and capture with the backend's build."""
    from .passes import PASSES

    steps = manifest["pipeline"]
    calibrated = [s for s in steps if s["name"] in PASSES and PASSES[s["name"]].calibrated]
    calibration = sum(s["seconds"] for s in calibrated)
    passes = sum(s["seconds"] for s in steps) - calibration
    parts = [
        f"{s['name']} {s['seconds']:.1f} s" + (" cached" * bool(s["stats"].get("calibration_cached")))
        for s in calibrated
    ]
    spent = [f"calibration {calibration:.1f} s ({', '.join(parts)})"] if calibrated else []
    spent += [
        f"other passes {passes:.1f} s",
        f"capture and the {manifest['backend']} build {seconds - calibration - passes:.1f} s",
    ]
    return f"compiled in {seconds:.1f} s: {'; '.join(spent)}"


def load_compiled(
    model: str | Path,
    request: CompileRequest,
    open_artifact: Callable[[Path], T],
    *,
    verify: bool = False,
    notify: Callable[[str], None] = lambda message: None,
) -> T:
    """`open_artifact(entry)` on MODEL's cached artifact for `request`, compiling it first when it is missing,
    stale or damaged (an ArtifactError from open_artifact: a file that fails its hash). `notify` gets a line
    when compiling or waiting for another process; `verify` checks each pass when compiling. Every compile runs the
    built artifact against the torch reference before caching it (api.compile_artifact's check_artifact)."""
    from .frontend import resolve_model

    source = resolve_model(model)
    key = cache_key(source, request)
    entry = entry_path(model, key, request)
    if (entry / KEY_FILE).is_file():
        with locked(entry, exclusive=False, notify=notify):
            if stored_key(entry) == key:
                try:
                    return open_artifact(entry)
                except ArtifactError:
                    pass  # checked again, named and compiled below
    with locked(entry, exclusive=True, notify=notify):
        reason = why_stale(entry, key)  # another process may have compiled it while we waited
        if reason is not None:
            when = f"again ({reason})" if entry.exists() else "once"
            weights = request.quant if request.quant != "none" else "unquantized weights"
            what = f"{model} with {weights} for {request.backend}/{request.target}"
            notify(f"compiling {what} {when}, cached at {entry}")
            started = time.perf_counter()
            compile_entry(source, entry, request, key, verify)
            notify(compile_time(read_manifest(entry, verify=False), time.perf_counter() - started))
        return open_artifact(entry)
