"""The artifact directory: manifest.json + the backend's files + tokenizer files, every file hashed.

Written into a temporary sibling directory and renamed into place when complete, so a crash never leaves
a half-written artifact; loading checks the format version and every file's sha256 and names what is wrong.

An artifact is code: TVM's model.so is a shared library the loading process runs, and an MLIR artifact's module
is compiled to native code when it loads, so load only artifacts you trust (ones you compiled, or that come from
someone you would let run programs on the machine). The checks here catch corruption, mistakes and hand edits, not
a malicious author: before anything is read `read_manifest` checks that every path the manifest names (its
`files` and each `file` field: entry points, weights, device code, the block-copy model) stays inside the
directory (relative, no `..`, no symlink leading out) and is hashed, and that every file the runtime reads by
name (TOKENIZER_FILES) is hashed too: a stray, unlisted chat_template.jinja is refused, never read.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path, PurePosixPath
from typing import Any

from ..errors import LlmlowerError
from ..spec import ModelSpec

MANIFEST = "manifest.json"
# 2: KV layouts "slots" and "paged" (continuous batching); 3: the logits_indices step input; 4: weights.tensors
# lists every weight's name, shape and dtype (runtime.weights: dummy weights without the weights file); 5: the
# executor field names the runtime executor that runs it ("module:Class" of runtime.executors)
FORMAT_VERSION = 5
# Files the runtime reads by name rather than through a manifest field (runtime.tokenizer.Tokenizer.from_dir):
# tokenizer.json must be hashed; the others, when present, must be hashed too (else the artifact is refused).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
REQUIRED_FILES = ("tokenizer.json",)
REQUIRED_FIELDS = {"backend": str, "executor": str, "target": str, "dtype": str, "kv_layout": dict, "spec": dict}
JSON_TYPES = {str: "string", dict: "object"}


class ArtifactError(LlmlowerError):
    """An artifact directory is missing, of another format version, or corrupted."""


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def is_artifact(path: str | Path) -> bool:
    return (Path(path) / MANIFEST).is_file()


def check_output(directory: str | Path, flag: str = "--output") -> Path:
    """Refuse an output path compiling must not replace (a file, or a directory that is neither empty nor an
    artifact) or cannot write (its parent is a file or not writable), before minutes of compiling."""
    directory = Path(directory).expanduser()
    if directory.is_symlink() or (directory.exists() and not directory.is_dir()):
        raise ArtifactError(f"{flag} {directory}: exists and is not a directory; compile writes an artifact directory")
    if directory.is_dir() and not is_artifact(directory) and any(directory.iterdir()):
        raise ArtifactError(
            f"{flag} {directory}: a directory that is not an llmlower artifact (no {MANIFEST}) and not empty; "
            "compile replaces only a previous artifact"
        )
    parent = directory.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise ArtifactError(f"{flag} {directory}: {parent} is not a directory")
    try:  # can we create the staging directory there? (access() says yes to root even on read-only mounts)
        os.rmdir(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=parent))
    except OSError as exc:
        raise ArtifactError(f"{flag} {directory}: cannot write in {parent} ({exc.strerror or exc})") from None
    return directory


def write_artifact(
    directory: str | Path,
    write_files: Callable[[Path], None],
    manifest: dict[str, Any],
    check_staged: Callable[[Path], None] | None = None,
) -> Path:
    """Call `write_files(staging_dir)`, hash what it wrote, add manifest.json, call `check_staged(staging_dir)` on
    the complete artifact (compile --verify runs it there: raising removes it, so a refused artifact never reaches
    `directory`), then move the directory to `directory` (replacing an existing artifact only once the new one is
    complete; anything else at `directory` is refused, never replaced)."""
    directory = check_output(directory)
    try:
        directory.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    except OSError as exc:
        raise ArtifactError(f"--output {directory}: cannot write there ({exc.strerror or exc})") from None
    try:
        write_files(staging)
        files = sorted(p for p in staging.rglob("*") if p.is_file())
        manifest = {
            "format_version": FORMAT_VERSION,
            **manifest,
            "files": {str(p.relative_to(staging)): sha256(p) for p in files},
        }
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=2), encoding="utf-8")
        for file in [*files, staging / MANIFEST]:
            file.chmod(0o644)  # readable by the service that deploys it, whoever compiled it
        staging.chmod(0o755)
        if check_staged is not None:
            check_staged(staging)
        if directory.exists():
            old = directory.with_name(f".{directory.name}.old")
            shutil.rmtree(old, ignore_errors=True)  # an interrupted replace's: `directory` is whole, so it is stale
            directory.rename(old)
            try:
                staging.rename(directory)
            except BaseException:
                old.rename(directory)  # put the previous artifact back
                raise
            shutil.rmtree(old)
        else:
            staging.rename(directory)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return directory


def named_files(manifest: Any, field: str = "") -> Iterator[tuple[str, Any]]:
    """(field, value) of every `file` entry in the manifest, at any depth: entry_points.step.file,
    weights.file, tvm.device_code.file, ..."""
    if isinstance(manifest, dict):
        for key, value in manifest.items():
            name = f"{field}.{key}" if field else str(key)
            if key == "file":
                yield name, value
            elif key != "files":
                yield from named_files(value, name)
    elif isinstance(manifest, list):
        for index, value in enumerate(manifest):
            yield from named_files(value, f"{field}[{index}]")


def _check_path(directory: Path, root: Path, field: str, name: Any) -> None:
    """`name` must be a relative path inside the artifact (no `..`, nothing absolute, no symlink leading out)."""
    where = f"{directory / MANIFEST}: {field}"
    if not isinstance(name, str) or not name:
        raise ArtifactError(f"{where} {name!r}: expected a file name inside the artifact")
    path = PurePosixPath(name)
    if path.is_absolute() or "\\" in name or (len(name) > 1 and name[1] == ":"):
        raise ArtifactError(f"{where} {name!r}: an absolute path; files must lie inside the artifact directory")
    if ".." in path.parts:
        raise ArtifactError(f"{where} {name!r}: leaves the artifact directory ('..')")
    resolved = (directory / name).resolve()
    if not resolved.is_relative_to(root):
        raise ArtifactError(f"{where} {name!r}: resolves to {resolved}, outside {root} (a symlink leading out)")


def check_manifest_paths(directory: Path, manifest: dict[str, Any]) -> dict[str, str]:
    """Check every path the manifest names (before any is read) and return its hashed file list: each name in
    `files` and each `file` field lies inside the directory, each `file` field and every file the runtime reads
    by name is listed in `files` (so hashed)."""
    files = manifest.get("files")
    if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()):
        raise ArtifactError(f"{directory / MANIFEST}: field 'files' is missing or not an object of name to sha256")
    root = directory.resolve()
    for name in files:
        _check_path(directory, root, f"files[{name!r}]", name)
    for field, name in named_files(manifest):
        _check_path(directory, root, field, name)
        if name not in files:
            raise ArtifactError(f"{directory / MANIFEST}: {field} {name!r} is not in the manifest's files (not hashed)")
    for name in TOKENIZER_FILES:
        if name in files:
            continue
        if name in REQUIRED_FILES:
            raise ArtifactError(f"{directory / MANIFEST}: {name} is not in the manifest's files")
        if os.path.lexists(directory / name):
            raise ArtifactError(
                f"{directory / name}: not in {MANIFEST}'s files (not hashed), so it is not read; remove it, or "
                "recompile to include it"
            )
    return files


def read_manifest(directory: str | Path, verify: bool = True, weights: bool = True) -> dict[str, Any]:
    """The manifest of an artifact, after checking its format version, the paths it names (see
    check_manifest_paths) and (with `verify`) every file's hash. Without `weights` (dummy weights will be made
    up instead) the weights file the manifest names is not read, so it may be absent and is not hashed."""
    directory = Path(directory)
    path = directory / MANIFEST
    if not path.is_file():
        raise ArtifactError(f"{path}: not found ({directory} is not an llmlower artifact)")
    if not path.resolve().is_relative_to(directory.resolve()):
        raise ArtifactError(f"{path}: a symlink leading out of the artifact directory")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ArtifactError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(manifest, dict):
        raise ArtifactError(f"{path}: expected a JSON object, found {type(manifest).__name__}")
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise ArtifactError(
            f"{path}: format_version {version!r}; this llmlower reads version {FORMAT_VERSION} (compile it again)"
        )
    _check_fields(path, manifest)
    files = check_manifest_paths(directory, manifest)
    listed = manifest.get("weights")
    unread = {listed.get("file")} if not weights and isinstance(listed, dict) else set()
    for name, expected in files.items():
        if name in unread:
            continue
        file = directory / name
        if not file.is_file():
            raise ArtifactError(f"{file}: listed in {MANIFEST} but missing")
        if verify and sha256(file) != expected:
            raise ArtifactError(f"{file}: sha256 does not match {MANIFEST} (the file is corrupted or was changed)")
    return manifest


def _check_fields(path: Path, manifest: dict[str, Any]) -> None:
    """Every field the runtime reads is there with its type, and the spec makes a ModelSpec: else one line naming
    the field (a hand-edited or truncated manifest)."""
    for name, kind in REQUIRED_FIELDS.items():
        if not isinstance(manifest.get(name), kind):
            raise ArtifactError(f"{path}: field {name!r} is missing or not a JSON {JSON_TYPES[kind]}")
    try:
        ModelSpec.from_dict(manifest["spec"])
    except (TypeError, ValueError) as error:
        raise ArtifactError(f"{path}: field 'spec' is not a model spec ({error})") from None


def kv_cache_dtype(manifest: dict[str, Any]) -> str:
    """The dtype an artifact keeps its KV cache in: its kv_layout's (int8 after the kv_cache_dtype pass), else the
    model's (artifacts written before the field)."""
    return manifest["kv_layout"].get("dtype", manifest["dtype"])


def embedding_pooling(pipeline: list[dict[str, Any]]) -> str | None:
    """How an embedding model's rows become one vector a text (its embed pass's pooling: last or mean), from an
    artifact's pipeline (the manifest's, or a Program's history as dicts); None for a model that generates."""
    options = [record.get("options", {}) for record in pipeline if record.get("name") == "embed"]
    return options[0].get("pooling", "last") if options else None


def draft_dir_name(layers: int) -> str:
    """The directory, inside the target artifact, of its self-draft with `layers` decoder layers."""
    return f"draft-layers-{layers}"


def draft_key(layers: int) -> str:
    """The self-draft's key in the target manifest's `drafts`."""
    return f"layers-{layers}"


def draft_artifact(artifact: str | Path, layers: int, verify: bool = False, weights: bool = True) -> Path:
    """The checked path of the self-draft with `layers` decoder layers that `compile --draft-layers` put inside
    `artifact` (an artifact of its own: the target's first layers, final norm and LM head).

    The target manifest's `drafts` entry must name a directory inside the artifact whose manifest.json is hashed
    in the target's files and matches the recorded manifest_sha256; the draft's own manifest must pass
    read_manifest (with `verify`, every file's hash: Engine.load checks them anyway), say `layers` layers, and
    have the target's KV layout apart from the layer count (the runtime runs both on the same block tables).
    Without `weights` (dummy weights), neither artifact's weights file is needed."""
    directory = Path(artifact)
    manifest = read_manifest(directory, verify=False, weights=weights)
    where = f"{directory / MANIFEST}: drafts"
    drafts = manifest.get("drafts", {})
    if not isinstance(drafts, dict):
        raise ArtifactError(f"{where}: expected an object of self-drafts, found {type(drafts).__name__}")
    entry = drafts.get(draft_key(layers))
    if entry is None:
        have = sorted(str(e.get("layers")) for e in drafts.values() if isinstance(e, dict))
        has = f"it has self-drafts of {', '.join(have)} decoder layers" if have else "it has no self-draft"
        raise ArtifactError(
            f"{directory}: no self-draft with {layers} decoder layers ({has}); compile with --draft-layers {layers}"
        )
    key = f"{where}[{draft_key(layers)!r}]"
    if not isinstance(entry, dict) or not isinstance(entry.get("path"), str):
        raise ArtifactError(f"{key}: expected an object with a 'path'")
    name = entry["path"]
    _check_path(directory, directory.resolve(), f"drafts[{draft_key(layers)!r}].path", name)
    draft = directory / name
    listed = f"{name}/{MANIFEST}"
    if entry.get("file") != listed or listed not in manifest["files"]:
        raise ArtifactError(f"{key}: its manifest {listed} is not listed in {MANIFEST}'s files (not hashed)")
    recorded = entry.get("manifest_sha256")
    if recorded != manifest["files"][listed]:
        raise ArtifactError(f"{key}: manifest_sha256 differs from the hash of {listed} in {MANIFEST}'s files")
    if not (draft / MANIFEST).is_file():
        raise ArtifactError(f"{draft / MANIFEST}: listed in {directory / MANIFEST} but missing")
    if sha256(draft / MANIFEST) != recorded:
        raise ArtifactError(f"{draft / MANIFEST}: sha256 does not match {directory / MANIFEST} (changed or corrupted)")
    own = read_manifest(draft, verify=verify, weights=weights)
    if (own.get("spec") or {}).get("num_layers") != layers:
        raise ArtifactError(f"{draft / MANIFEST}: spec.num_layers is not {layers}, as {key} says")
    target_kv, draft_kv = manifest.get("kv_layout") or {}, own.get("kv_layout") or {}
    differs = [f for f in set(target_kv) | set(draft_kv) if f != "layers" and target_kv.get(f) != draft_kv.get(f)]
    if differs or draft_kv.get("layers") != layers:
        raise ArtifactError(
            f"{draft / MANIFEST}: kv_layout differs from the target's ({', '.join(sorted(differs)) or 'layers'}); "
            "a self-draft runs on the target's block tables"
        )
    return draft
