"""Pipelines from the command line's words: --passes a,b,c and --quant q8 | q4g32 | q4g128-sym | none."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from ..errors import PassError
from .manager import PassSpec
from .registry import PASSES

FUSION: tuple[str, ...] = ("fuse_norms", "fuse_rope", "fuse_projections")
DEFAULT_PIPELINE: tuple[str, ...] = ("canonicalize", *FUSION, "kv_cache", "fuse_qkv_attention", "last_token_logits")
QUANT_NAMES = "none, q8, q8g64, q8g128, q4g32, q4g64, q4g128 (asymmetric; -zp4: 4-bit zero points; -sym: symmetric)"
_INT8 = re.compile(r"q8(?:g(32|64|128))?")
_INT4 = re.compile(r"q4g(32|64|128)(-sym|-zp4)?")


def parse_quant(name: str) -> dict[str, Any] | None:
    """quantize_weights options for a short name; None for 'none'."""
    if name == "none":
        return None
    match = _INT8.fullmatch(name)
    if match is not None:
        return {"bits": 8, "group": int(match.group(1) or 32)}
    match = _INT4.fullmatch(name)
    if match is None:
        raise PassError(f"--quant {name!r}: expected one of {QUANT_NAMES}")
    variant = match.group(2)
    options: dict[str, Any] = {"bits": 4, "group": int(match.group(1)), "symmetric": variant == "-sym"}
    if variant == "-zp4":
        options["packed_zeros"] = True
    return options


def build_pipeline(
    passes: str | Sequence[str] | None = None,
    quant: str = "none",
    keep: Sequence[str] = (),
    quantize_embedding: bool = False,
    all_logits: bool = False,
    lm_head_bits: int | None = None,
) -> list[PassSpec]:
    """The pass list for `passes` (comma-separated names, default DEFAULT_PIPELINE) and the quant options
    (`lm_head_bits`: 8 or 4 for the LM head, default 8). `all_logits` leaves out last_token_logits
    (perplexity scores every position)."""
    names = list(DEFAULT_PIPELINE) if passes is None else passes
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]
    for name in names:
        if name not in PASSES:
            raise PassError(f"--passes: unknown pass {name!r} (registered: {', '.join(PASSES)})")
    pipeline: list[PassSpec] = [n for n in names if not (all_logits and n == "last_token_logits")]
    options = parse_quant(quant)
    if options is None and (keep or quantize_embedding or lm_head_bits):
        raise PassError("--keep, --quant-embedding and --lm-head-bits need --quant")
    if options is not None:
        options.update(
            keep_lm_head="lm_head" in keep,
            keep=[k for k in keep if k != "lm_head"],
            quantize_embedding=quantize_embedding,
        )
        if lm_head_bits is not None:
            options["lm_head_bits"] = lm_head_bits
        pipeline.append(("quantize_weights", options))
    return pipeline
