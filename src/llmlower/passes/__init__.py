"""Graph -> graph rewrites: each pass is a module that registers itself; the manager runs pipelines."""

from . import (  # noqa: F401  (registration)
    awq,
    canonicalize,
    draft_layers,
    eager_attention,
    embed,
    fuse_norms,
    fuse_projections,
    fuse_qkv_attention,
    fuse_rope,
    gptq,
    kv_cache,
    kv_cache_dtype,
    last_token_logits,
    latent_cache,
    lora,
    paged_attention,
    quantize_weights,
    smoothquant,
    state_cache,
)
from .manager import run_pipeline
from .pipelines import DEFAULT_PIPELINE, FUSION, build_pipeline, parse_quant, with_kv_layout
from .registry import PASSES, Pass, register_pass

__all__ = [
    "DEFAULT_PIPELINE",
    "FUSION",
    "PASSES",
    "Pass",
    "build_pipeline",
    "parse_quant",
    "register_pass",
    "run_pipeline",
    "with_kv_layout",
]
