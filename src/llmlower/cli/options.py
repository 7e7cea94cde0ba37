"""The options several commands share, as argparse groups: the pass pipeline, sampling (named after
SamplingParams' fields), the engine's serving limits; and the value parsers they use."""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

from ..backends.registry import BACKENDS
from ..recipes import AUTO, QUALITY_GATE, RECIPES
from ..runtime import EngineConfig
from ..step_io import KV_CACHE_DTYPES

VERIFY_HELP = (
    "check each pass numerically against the one before, then the built artifact, run by its own runtime, against "
    "the torch reference (refused beyond its backend's tolerance)"
)
MODEL_HELP = "a checkpoint directory, a .gguf file, 'example' (SmolLM2-135M-Instruct) or (generate) an artifact"
DEFAULT_STEP_TOKENS = EngineConfig.max_num_batched_tokens
DEFAULT_SPECULATIVE_TOKENS = 4
MAX_LORAS = 4  # adapter slots of a model compiled with --lora-rank alone


def parse_bytes(text: str) -> int:
    """A size in bytes: a number with an optional K, M, G (powers of 1024; KiB, MB, ... read the same)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if match is None:
        raise argparse.ArgumentTypeError(f"expected a size like 2G, 512M or 1073741824, got {text!r}")
    number, unit = match.groups()
    return int(float(number) * 1024 ** "BKMG".index(unit.upper() or "B"))


def add_pipeline_options(parser: argparse.ArgumentParser, recipe_default: str | None = AUTO) -> None:
    """--recipe (`recipe_default` unless given: None, the flags alone), --passes, --quant and the other pass
    pipeline options, --dtype and --kv-cache-dtype."""
    default = f"default {recipe_default}" if recipe_default else "default: none, the flags alone"
    parser.set_defaults(default_recipe=recipe_default)
    parser.add_argument(
        "--recipe",
        metavar="NAME",
        help=f"named compile settings ({default}): {AUTO}, the fastest recipe within +{QUALITY_GATE:g}%% of fp32's "
        f"perplexity for this CPU and the backends installed; "
        + "; ".join(f"{r.name}: {r.flags}" for r in RECIPES.values())
        + ". --backend, --quant (with its options) and --kv-cache-dtype given explicitly win",
    )
    parser.add_argument("--passes", help="comma-separated passes (default: the default pipeline; see `passes`)")
    parser.add_argument(
        "--task",
        choices=["generate", "embed"],
        default="generate",
        help="generate (default) continues text; embed compiles a text-embedding model (hidden states instead of "
        "logits, pooled into one normalized vector a text: /v1/embeddings), recipe exact unless --recipe says",
    )
    parser.add_argument(
        "--pooling", choices=["last", "mean"], help="--task embed: the last token's hidden state (default) or the mean"
    )
    parser.add_argument(
        "--quant",
        help="weight quantization: none, q8, q8c (int8 per channel), q4g32, q4g64, q4g128 (add -sym: symmetric, "
        "-zp4: 4-bit zero points), q4mix (int4 where it keeps quality, int8 elsewhere), q4mix-a8 (q4mix with int8 "
        "per channel and int8 activations), q4mlp-a8 (q4mix-a8 with int4 for the MLP's gate/up alone); default: the "
        "recipe's",
    )
    parser.add_argument(
        "--keep", action="append", default=[], help="keep in full precision: lm_head or a weight-name substring"
    )
    parser.add_argument("--quant-embedding", action="store_true", help="also quantize the embedding table")
    parser.add_argument("--lm-head-bits", type=int, choices=[4, 8], help="LM head under --quant (default 8)")
    parser.add_argument(
        "--scale-dtype",
        choices=["auto", "float16"],
        help="the quantized weights' scales: auto, the model's dtype; float16, 16 bits as llama.cpp keeps them "
        "(a 4-bit weight in groups of 32: 4.5 bits instead of 5 beside float32; the tvm backend reads them so, "
        "onnx widens them to the activations' type in the exported model)",
    )
    parser.add_argument(
        "--awq",
        action="store_true",
        help="activation-aware scales before int4 --quant (the awq pass: calibrated on a built-in text)",
    )
    parser.add_argument(
        "--gptq",
        action="store_true",
        help="round --quant's weights by GPTQ instead of to nearest (the gptq pass: calibrated on a built-in text)",
    )
    parser.add_argument(
        "--dtype", choices=["float32", "float16", "bfloat16"], help="default float32 (compile for cuda: float16)"
    )
    parser.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        help="default: the recipe's; auto: the model's dtype; float16: half of a float32 model's KV bytes (tvm and "
        "torch on the cpu); "
        "int8: a quarter, scales per kv head and channel calibrated when compiling (onnx, tvm, mlir and torch on "
        "the cpu)",
    )
    lora = parser.add_argument_group("LoRA adapter slots (the lora pass; adapters load at run time: --lora)")
    lora.add_argument(
        "--lora-rank", type=int, metavar="R", help="compile with adapter slots of up to rank R (default: none)"
    )
    lora.add_argument(
        "--max-loras", type=int, metavar="N", help=f"adapters loaded at once, with --lora-rank (default {MAX_LORAS})"
    )
    lora.add_argument(
        "--lora-targets",
        metavar="NAMES",
        help="comma-separated linears that take adapters, by last module name (q_proj,v_proj; default: every "
        "linear of the decoder layers)",
    )


SAMPLING_FLAGS: dict[str, dict[str, Any]] = {  # SamplingParams field -> argparse options of --field-name
    "temperature": {"type": float, "default": 0.0, "help": "0 (default) is greedy"},
    "top_k": {"type": int},
    "top_p": {"type": float},
    "min_p": {"type": float},
    "repetition_penalty": {"type": float},
    "frequency_penalty": {"type": float},
    "presence_penalty": {"type": float},
    "logit_bias": {"help": "JSON object of token id to bias, e.g. '{\"42\": -100}'"},
    "seed": {"type": int},
    "max_tokens": {"type": int, "default": 128, "help": "most new tokens (default 128)"},
    "min_tokens": {"type": int},
    "stop": {"action": "append", "help": "a stop string (repeatable)"},
    "stop_token_ids": {"type": int, "action": "append", "help": "a stop token id (repeatable)"},
    "ignore_eos": {"action": "store_const", "const": True},
    "include_stop_str_in_output": {"action": "store_const", "const": True},
    "logprobs": {"action": "store_const", "const": True},
    "top_logprobs": {"type": int},
    "n": {"type": int, "help": "completions of the prompt"},
}


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    """The sampling flags (named after SamplingParams' fields), then the serving and pipeline options."""
    group = parser.add_argument_group("sampling (see llmlower.runtime.sampling_params.SamplingParams)")
    for name, options in SAMPLING_FLAGS.items():
        group.add_argument(f"--{name.replace('_', '-')}", dest=name, **options)
    structured = "(needs llmlower[structured])"
    group.add_argument(
        "--json-schema", type=Path, metavar="FILE", help=f"the output is JSON of this schema {structured}"
    )
    group.add_argument("--regex", help=f"the output matches this regular expression {structured}")
    group.add_argument(
        "--grammar", type=Path, metavar="FILE", help=f"the output follows this Lark grammar {structured}"
    )
    group.add_argument("--lora-name", metavar="NAME", help="the LoRA adapter (loaded by --lora) that answers")
    add_serving_options(parser, "the completions asked for")


def add_serving_options(parser: argparse.ArgumentParser, default_seqs: str) -> None:
    """--backend, context, the engine's serving limits, threads and the pipeline options."""
    parser.add_argument(
        "--backend",
        choices=list(BACKENDS),
        help="what runs MODEL (default: the recipe's): onnx, tvm or mlir (linalg, JIT-compiled: slow), compiled "
        "once and cached under $LLMLOWER_CACHE/artifacts (default ~/.cache/llmlower); torch, the reference (not "
        "compiled)",
    )
    parser.add_argument("--max-context", type=int, default=2048, help="longest sequence in tokens (default 2048)")
    serving = parser.add_argument_group("serving (continuous batching, paged KV cache)")
    serving.add_argument("--max-num-seqs", type=int, help=f"sequences per step (default: {default_seqs})")
    serving.add_argument(
        "--max-num-batched-tokens",
        type=int,
        help=f"tokens per step, prompt chunks + decodes (default {DEFAULT_STEP_TOKENS}, or --max-num-seqs if more)",
    )
    serving.add_argument(
        "--block-size", type=int, help="KV block size in tokens (default 16; fixed by a paged artifact)"
    )
    serving.add_argument("--num-blocks", type=int, help="KV pool size in blocks")
    serving.add_argument(
        "--kv-cache-memory",
        type=parse_bytes,
        help="KV pool size in bytes, e.g. 2G (default: max-num-seqs full contexts)",
    )
    serving.add_argument("--no-prefix-caching", action="store_true", help="do not reuse the KV of cached prefixes")
    serving.add_argument(
        "--speculative",
        metavar="ngram|draft:PATH|self:K",
        help="speculative decoding: prompt lookup, a draft artifact with the same tokenizer, or the self-draft "
        "of K layers that `compile --draft-layers K` wrote into the artifact",
    )
    serving.add_argument(
        "--num-speculative-tokens",
        type=int,
        help=f"tokens proposed per step with --speculative (default {DEFAULT_SPECULATIVE_TOKENS})",
    )
    parser.add_argument(
        "--lora",
        action="append",
        default=[],
        metavar="NAME=PATH",
        dest="loras",
        help="load a PEFT LoRA adapter directory under NAME (repeatable); a model compiled here gets slots of the "
        "adapters' largest rank unless --lora-rank says",
    )
    parser.add_argument("--threads", type=int, default=0, help="artifact: intra-op threads (default: one per core)")
    parser.add_argument("--verify", action="store_true", help=VERIFY_HELP)
    add_pipeline_options(parser)
