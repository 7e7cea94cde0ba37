"""Calibrated passes' results kept on disk, so that compiling a model again (another backend, KV dtype or a new
toolkit) skips the minutes of calibration: the smoothing scales smoothquant searched, the weights gptq rounded.

A result is a dict of tensors in one safetensors file named by a digest of everything it depends on: the pass,
its options (the calibration tokens among them), the program it ran on (its code and every constant's bytes) and
the source of the passes and the IR. Any change to one of them is a new file; nothing stale is read. The store is
off unless a compile opens it (`calibration_store(directory)`, as api.compile_artifact does under the cache
directory); files are written whole (a temporary file renamed into place) and read with safetensors, never pickle.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from ..ir.program import Program

_directory: Path | None = None
_SOURCES = (Path(__file__).resolve().parent, Path(__file__).resolve().parent.parent / "ir")


@contextlib.contextmanager
def calibration_store(directory: Path | None) -> Iterator[None]:
    """Keep calibrated passes' results under `directory` (None: not at all) while the block runs."""
    global _directory
    previous, _directory = _directory, directory
    try:
        yield
    finally:
        _directory = previous


def _source_digest() -> str:
    digest = hashlib.sha256()
    for root in _SOURCES:
        for path in sorted(root.rglob("*.py")):
            digest.update(path.read_bytes())
    return digest.hexdigest()


def program_digest(program: Program) -> str:
    """sha256 of a program's code and its constants (names, dtypes, shapes and bytes)."""
    gm = program.graph_module
    digest = hashlib.sha256(gm.code.encode())
    tensors = dict(gm.named_parameters(remove_duplicate=False)) | dict(gm.named_buffers(remove_duplicate=False))
    for name in sorted(tensors):
        tensor = tensors[name].detach()
        digest.update(f"{name}\0{tensor.dtype}\0{tuple(tensor.shape)}\0".encode())
        digest.update(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


def remembered(
    name: str, program: Program, options: dict[str, Any], compute: Callable[[], dict[str, torch.Tensor]]
) -> tuple[dict[str, torch.Tensor], bool]:
    """`compute()`'s tensors for pass `name` with `options` on `program`, read from the store when it holds them
    (then True) and written to it when computed; without a store, computed."""
    if _directory is None:
        return compute(), False
    from safetensors import SafetensorError
    from safetensors.torch import load_file, save_file

    key = json.dumps([name, options, program_digest(program), _source_digest()], sort_keys=True, default=str)
    path = _directory / f"{name}-{hashlib.sha256(key.encode()).hexdigest()[:32]}.safetensors"
    if path.is_file():
        try:
            return load_file(path), True
        except (OSError, SafetensorError):  # a damaged file (a full disk): computed again and replaced
            pass
    tensors = compute()
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, staged = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(handle)
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, staged)
        os.replace(staged, path)
    finally:
        Path(staged).unlink(missing_ok=True)
    return tensors, False
