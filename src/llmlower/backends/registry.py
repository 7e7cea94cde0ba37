"""The registered backends: one line each in BACKEND_PACKAGES, the package under llmlower.backends whose
`BACKEND` (backend.Backend) says everything else. The compile command, the Python API, the roofline study and
compile --verify read this table; the runtime never does (an artifact's manifest names its executor)."""

from __future__ import annotations

import importlib

from ..errors import LlmlowerError
from .backend import Backend

BACKEND_PACKAGES = ("torch", "onnx", "tvm", "mlir")

BACKENDS: dict[str, Backend] = {
    backend.name: backend
    for backend in (importlib.import_module(f".{package}", __package__).BACKEND for package in BACKEND_PACKAGES)
}


def get_backend(name: str) -> Backend:
    """The backend registered as `name` (an unknown one is refused, naming those there are)."""
    if name not in BACKENDS:
        raise LlmlowerError(f"--backend {name!r}: available backends are {', '.join(BACKENDS)}")
    return BACKENDS[name]
