"""llmlower: capture a transformers LLM with torch.export, rewrite it with passes, run it with a small runtime.

Names are imported lazily, so `import llmlower.runtime` does not pull in torch or transformers.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "compile_program": "llmlower.api",
    "load_engine": "llmlower.api",
    "compile_model": "llmlower.api",
    "load_model": "llmlower.api",
    "RECIPES": "llmlower.recipes",
    "load": "llmlower.frontend",
    "capture": "llmlower.frontend",
    "run_pipeline": "llmlower.passes",
    "DEFAULT_PIPELINE": "llmlower.passes",
    "Program": "llmlower.ir",
    "Engine": "llmlower.runtime",
    "AsyncEngine": "llmlower.runtime",
    "SamplingParams": "llmlower.runtime",
    "GenerationResult": "llmlower.runtime",
    "Tokenizer": "llmlower.runtime",
    "ModelSpec": "llmlower.spec",
    "LlmlowerError": "llmlower.errors",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'llmlower' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
