"""Frontend: checkpoint -> transformers' torch module + ModelSpec -> captured Program."""

from .capture import capture
from .checkpoint import LoadedModel, TokenizerFiles, load, save_checkpoint
from .example import cache_dir, example_checkpoint, example_gguf, resolve_model

__all__ = [
    "LoadedModel",
    "TokenizerFiles",
    "cache_dir",
    "capture",
    "example_checkpoint",
    "example_gguf",
    "load",
    "resolve_model",
    "save_checkpoint",
]
