"""Graph -> graph rewrites: each pass is a module that registers itself; the manager runs pipelines."""

from . import canonicalize, kv_cache  # noqa: F401  (registration)
from .manager import run_pipeline
from .registry import PASSES, Pass, register_pass

DEFAULT_PIPELINE: tuple[str, ...] = ("canonicalize", "kv_cache")

__all__ = ["DEFAULT_PIPELINE", "PASSES", "Pass", "register_pass", "run_pipeline"]
