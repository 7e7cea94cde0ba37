"""The artifact directory: manifest.json + the backend's files + tokenizer files, every file hashed.

Written into a temporary sibling directory and renamed into place when complete, so a crash never leaves
a half-written artifact; loading checks the format version and every file's sha256 and names what is wrong.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import LlmlowerError

MANIFEST = "manifest.json"
FORMAT_VERSION = 2  # 2: KV layouts 'slots' and 'paged' (continuous batching)


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


def write_artifact(directory: str | Path, write_files: Callable[[Path], None], manifest: dict[str, Any]) -> Path:
    """Call `write_files(staging_dir)`, hash what it wrote, add manifest.json, then move the directory to
    `directory` (replacing an existing artifact only once the new one is complete)."""
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
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
        if directory.exists():
            old = directory.with_name(f".{directory.name}.old")
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


def read_manifest(directory: str | Path, verify: bool = True) -> dict[str, Any]:
    """The manifest of an artifact, after checking its format version and (with `verify`) every file's hash."""
    directory = Path(directory)
    path = directory / MANIFEST
    if not path.is_file():
        raise ArtifactError(f"{path}: not found ({directory} is not an llmlower artifact)")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ArtifactError(f"{path}: not valid JSON ({exc})") from None
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise ArtifactError(f"{path}: format_version {version!r}; this llmlower reads version {FORMAT_VERSION}")
    for name, expected in manifest.get("files", {}).items():
        file = directory / name
        if not file.is_file():
            raise ArtifactError(f"{file}: listed in {MANIFEST} but missing")
        if verify and sha256(file) != expected:
            raise ArtifactError(f"{file}: sha256 does not match {MANIFEST} (the file is corrupted or was changed)")
    return manifest
