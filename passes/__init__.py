"""Graph -> graph rewrites: each pass is a module that registers itself; the manager runs pipelines."""

from . import (  # noqa: F401  (registration)
    canonicalize,
    fuse_norms,
    fuse_projections,
    fuse_rope,
    kv_cache,
    last_token_logits,
    quantize_weights,
)
from .manager import run_pipeline
from .registry import PASSES, Pass, register_pass

FUSION: tuple[str, ...] = ("fuse_norms", "fuse_rope", "fuse_projections")
DEFAULT_PIPELINE: tuple[str, ...] = ("canonicalize", *FUSION, "kv_cache", "last_token_logits")

__all__ = ["DEFAULT_PIPELINE", "FUSION", "PASSES", "Pass", "register_pass", "run_pipeline"]
