"""The part of an artifact's manifest every backend writes: versions, model spec, pipeline, backend, target."""

from __future__ import annotations

from typing import Any

from .. import __version__
from ..ir.program import Program


def program_manifest(program: Program, backend: str, target: str) -> dict[str, Any]:
    """Manifest entries describing what was compiled and for where; backends add their files and layout."""
    return {
        "toolkit_version": __version__,
        "backend": backend,
        "target": target,
        "dtype": program.spec.dtype,
        "spec": program.spec.to_dict(),
        "pipeline": [record.to_dict() for record in program.history],
    }
