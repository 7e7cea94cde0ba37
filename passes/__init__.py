"""Graph -> graph rewrites: each pass is a module that registers itself; the manager runs pipelines."""

from . import canonicalize, fuse_norms, fuse_projections, fuse_rope, kv_cache  # noqa: F401  (registration)
from .manager import run_pipeline
from .registry import PASSES, Pass, register_pass

FUSION: tuple[str, ...] = ("fuse_norms", "fuse_rope", "fuse_projections")
DEFAULT_PIPELINE: tuple[str, ...] = ("canonicalize", *FUSION, "kv_cache")

__all__ = ["DEFAULT_PIPELINE", "FUSION", "PASSES", "Pass", "register_pass", "run_pipeline"]
