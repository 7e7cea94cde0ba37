"""Pipelines from the command line's words: --passes a,b,c and --quant q8 | q4g32 | q4g128-sym | none."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from ..errors import PassError
from ..step_io import KVLayout
from .manager import PassSpec, pass_specs, pass_steps
from .quantize_weights import quant_plan
from .registry import PASSES
from .smoothquant import smooths

FUSION: tuple[str, ...] = ("fuse_norms", "fuse_rope", "fuse_projections")
# the paged_attention pass is added per backend and target (with_kv_layout)
DEFAULT_PIPELINE: tuple[str, ...] = (
    "canonicalize",
    "eager_attention",
    *FUSION,
    "state_cache",
    "kv_cache",
    "fuse_qkv_attention",
    "last_token_logits",
)
QUANT_NAMES = (
    "none, q8, q8g64, q8g128, q8c (per channel), q4g32, q4g64, q4g128 (asymmetric; -zp4: 4-bit zero points; "
    "-sym: symmetric), q4mix, q4mix-a8, q4mlp-a8"
)
# q4mix: q4g32-zp4 where int4 costs little quality (the attention output and the MLP's gate/up projections,
# ~60% of a Llama layer's weights), q8 for q/k/v and down, the projections most sensitive to int4's rounded zero
# points (SmolLM2, tests/data/perplexity.txt: q/k/v +10%, down +6%, o +1%, gate/up +3%), and q8c (per channel) for
# the LM head: ONNX Runtime's integer GEMM then multiplies it at 2x MatMulNBits' int8 rate on AVX2 (its per-row
# activations: 26.36 against 26.37 here, 23.39 against 23.31 on the calibration text; into q/k/v they cost +2.1%).
# No float zero points: no correction ops (MatMulNBits takes both natively). MoE experts follow the dense MLP
# ("up_proj" names their gate_up_proj): gate/up int4, down int8, measured on an upcycled SmolLM2 MoE
# (benchmarks/moe_perplexity.py: gate/up +8.6%, down +18.5%, both +23.5%).
# q4mix-a8: q4mix with q/k/v and down per channel too, for serving many streams: ONNX Runtime's integer GEMM
# takes them at 1.3-1.9x MatMulNBits' 8-bit rate at 16-100 rows, and is slower at one (its activations are rounded
# per row by extra ops); the smoothquant pass, which build_pipeline adds for any per-channel int8 linear, moves
# their inputs' outlier channels into the weights (SmolLM2, perplexity.txt: 26.61 against q4mix's 26.36, 27.05
# unsmoothed; fp32 25.48).
# q4mlp-a8: q4mix-a8 with the attention output in int8 groups of 32 (its activations rounded per group: its input,
# the attention's output, has outlier channels that no smoothing can take), int4 for the MLP's gate/up alone (~56%
# of a Llama layer's weights); SmolLM2's TVM artifact with GPTQ, scored one token a step on heldout.txt
# (benchmarks/recipe_quality.py): 29.43 against q4mix-a8's 29.83 (fp32 28.52), for 4% more bytes.
INT4_MLP = {"gate_proj": "q4g32-zp4", "up_proj": "q4g32-zp4"}
MIXES = {  # name -> (base, {weight name: its scheme}, the LM head's group)
    "q4mix": ("q8", {"o_proj": "q4g32-zp4", **INT4_MLP}, 0),
    "q4mix-a8": ("q8c", {"o_proj": "q4g32-zp4", **INT4_MLP}, 0),
    "q4mlp-a8": ("q8c", {"o_proj": "q8", **INT4_MLP}, 0),
}
_INT8 = re.compile(r"q8(?:g(32|64|128)|(c))?")
_INT4 = re.compile(r"q4g(32|64|128)(-sym|-zp4)?")


def parse_quant(name: str) -> dict[str, Any] | None:
    """quantize_weights options for a short name; None for 'none'."""
    if name == "none":
        return None
    if name in MIXES:
        base, special, head_group = MIXES[name]
        overrides = [[weight, parse_quant(scheme)] for weight, scheme in special.items()]
        return {**parse_quant(base), "overrides": overrides, "lm_head_group": head_group}
    match = _INT8.fullmatch(name)
    if match is not None:
        return {"bits": 8, "group": 0 if match.group(2) else int(match.group(1) or 32)}
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
    awq: bool = False,
    gptq: bool = False,
    scale_dtype: str | None = None,
    embed: str | None = None,
    lora: dict[str, Any] | None = None,
) -> list[PassSpec]:
    """The pass list for `passes` (comma-separated names, default DEFAULT_PIPELINE) and the quant options
    (`lm_head_bits`: 8 or 4 for the LM head, default 8; `awq`: the awq pass before quantize_weights, with the same
    options; per-channel int8 weights take the smoothquant pass there; `gptq`: the gptq pass in quantize_weights'
    place; `scale_dtype`: "float16" keeps the quantized weights' scales in 16 bits). `all_logits` leaves out
    last_token_logits (perplexity scores every position). `embed`: a text-embedding model pooled so (last or
    mean), the embed pass first. `lora`: the lora pass's options (rank, max_loras, targets), on the captured graph
    before any fusion."""
    names = list(DEFAULT_PIPELINE) if passes is None else passes
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]
    for name in names:
        if name not in PASSES:
            raise PassError(f"--passes: unknown pass {name!r} (registered: {', '.join(PASSES)})")
    pipeline: list[PassSpec] = [n for n in names if not (all_logits and n == "last_token_logits")]
    if embed is not None:  # on the captured graph, after canonicalize when it is there
        pipeline.insert(int(bool(pipeline) and pipeline[0] == "canonicalize"), ("embed", {"pooling": embed}))
    if lora is not None:  # after canonicalize and eager_attention, before the fusions see the linears
        fusing = [i for i, name in enumerate(pipeline) if name in FUSION or name == "kv_cache"]
        pipeline.insert(fusing[0] if fusing else len(pipeline), ("lora", dict(lora)))
    options = parse_quant(quant)
    if options is None and (keep or quantize_embedding or lm_head_bits or awq or gptq or scale_dtype):
        raise PassError("--keep, --quant-embedding, --lm-head-bits, --awq, --gptq and --scale-dtype need --quant")
    if options is not None:
        options.update(
            keep_lm_head="lm_head" in keep,
            keep=[k for k in keep if k != "lm_head"],
            quantize_embedding=quantize_embedding,
        )
        if lm_head_bits is not None:
            options["lm_head_bits"] = lm_head_bits
            if lm_head_bits == 4:  # an int4 head takes the weights' group (32 beside per-channel int8)
                options["lm_head_group"] = options["group"] or 32
        if scale_dtype is not None:
            options["scale_dtype"] = scale_dtype
        if awq:
            pipeline.append(("awq", {"quant": dict(options)}))
        if smooths(quant_plan("quantize_weights", options)):
            pipeline.append(("smoothquant", {"quant": dict(options)}))
        pipeline.append(("gptq" if gptq else "quantize_weights", options))
    return pipeline


def with_kv_layout(pipeline: Sequence[PassSpec], layout: KVLayout, block_size: int | None = None) -> list[PassSpec]:
    """The pipeline for a backend whose programs use `layout`: PAGED adds paged_attention (with `block_size`)
    before last_token_logits unless the pipeline has it; SLOTS refuses it."""
    steps = pass_steps(pipeline)
    names = [name for name, _ in steps]
    if layout is KVLayout.SLOTS:
        if "paged_attention" in names:
            raise PassError("this backend and target run programs with a per-sequence KV cache: drop paged_attention")
        return list(pipeline)
    if "kv_cache" not in names:
        raise PassError("a paged KV cache needs the kv_cache pass in the pipeline")
    if "paged_attention" in names:
        options = steps[names.index("paged_attention")][1]
        if block_size is not None and options.setdefault("block_size", block_size) != block_size:
            raise PassError(
                f"--block-size {block_size} differs from paged_attention's block_size {options['block_size']}"
            )
    else:
        at = names.index("last_token_logits") if "last_token_logits" in names else names.index("kv_cache") + 1
        if "fuse_qkv_attention" in names[at:]:
            at = names.index("fuse_qkv_attention") + 1
        steps.insert(at, ("paged_attention", {} if block_size is None else {"block_size": block_size}))
    return pass_specs(steps)
