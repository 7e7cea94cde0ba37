"""What the shared options build: the pass pipeline, the EngineConfig, SamplingParams (with a structured output),
the compile request of a model, and the Engine a command runs."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ..compile_cache import CompileRequest, load_compiled
from ..errors import LlmlowerError
from ..recipes import Choice, choose, recipe_settings
from ..runtime import EngineConfig
from .options import DEFAULT_SPECULATIVE_TOKENS, DEFAULT_STEP_TOKENS, MAX_LORAS, SAMPLING_FLAGS


def apply_recipe(args: argparse.Namespace) -> Choice | None:
    """Fill the settings a recipe names (backend, quantization, KV cache dtype) into `args` where they were not
    given, from --recipe or the command's default (add_pipeline_options); None for an artifact (compiled already)
    or without a recipe (the flags alone). Prints the choice and why on stderr."""
    from ..runtime.artifact import is_artifact

    embedding = getattr(args, "task", "generate") == "embed"
    asked = args.recipe or ("exact" if embedding and args.default_recipe else args.default_recipe)
    if asked is None or is_artifact(args.model):
        args.kv_cache_dtype = args.kv_cache_dtype or "auto"
        return None
    choice = choose(asked, {name: getattr(args, name, None) for name in recipe_settings()})
    for name, value in choice.settings.items():
        setattr(args, name, value)
    print(choice.line(), file=sys.stderr, flush=True)
    return choice


def pass_pipeline(args: argparse.Namespace, all_logits: bool = False) -> list:
    """The pass list the pipeline flags ask for (after apply_recipe: the recipe's where not given)."""
    from ..passes import build_pipeline

    task, pooling = getattr(args, "task", "generate"), getattr(args, "pooling", None)
    if pooling is not None and task != "embed":
        raise LlmlowerError("--pooling: only with --task embed")

    return build_pipeline(
        args.passes,
        args.quant or "none",
        args.keep,
        args.quant_embedding,
        all_logits=all_logits,
        lm_head_bits=args.lm_head_bits,
        awq=args.awq,
        gptq=args.gptq,
        scale_dtype=None if args.scale_dtype in (None, "auto") else args.scale_dtype,
        embed=(pooling or "last") if task == "embed" else None,
        lora=lora_options(args),
    )


def lora_options(args: argparse.Namespace) -> dict[str, Any] | None:
    """The lora pass's options from --lora-rank, --max-loras and --lora-targets; without --lora-rank, adapters
    given with --lora size the slots (their largest rank, and room for them all); None without either."""
    rank, slots, targets = getattr(args, "lora_rank", None), getattr(args, "max_loras", None), args.lora_targets
    adapters = lora_adapters(args)
    if rank is None and adapters:
        rank = max(adapter.rank for adapter in adapters.values())
    if rank is None:
        if slots is not None or targets:
            raise LlmlowerError("--max-loras and --lora-targets need --lora-rank (or --lora adapters)")
        return None
    options: dict[str, Any] = {"rank": rank, "max_loras": slots or max(MAX_LORAS, len(adapters))}
    if targets:
        options["targets"] = [t.strip() for t in targets.split(",") if t.strip()]
    return options


def lora_adapters(args: argparse.Namespace) -> dict[str, Any]:
    """--lora NAME=PATH: the adapters, read (a bad directory fails before anything compiles)."""
    from ..runtime.lora import LoraAdapter

    adapters = {}
    for given in getattr(args, "loras", []):
        name, equals, path = given.partition("=")
        if not equals or not name or not path:
            raise LlmlowerError(f"--lora {given!r}: expected NAME=PATH")
        if name in adapters:
            raise LlmlowerError(f"--lora {given!r}: {name} is given twice")
        adapters[name] = LoraAdapter.read(path)
    return adapters


def check_artifact_options(args: argparse.Namespace) -> None:
    """An artifact was compiled with its pipeline and dtype: options that would change them are an error."""
    from ..runtime.artifact import is_artifact

    if not is_artifact(args.model):
        return
    options = {
        "--recipe": args.recipe,
        "--backend": getattr(args, "backend", None),
        "--passes": args.passes,
        "--task": getattr(args, "task", "generate") != "generate",
        "--pooling": getattr(args, "pooling", None),
        "--lora-rank": getattr(args, "lora_rank", None),
        "--max-loras": getattr(args, "max_loras", None),
        "--lora-targets": args.lora_targets,
        "--quant": args.quant not in (None, "none"),
        "--keep": args.keep,
        "--quant-embedding": args.quant_embedding,
        "--lm-head-bits": args.lm_head_bits,
        "--awq": args.awq,
        "--gptq": args.gptq,
        "--scale-dtype": args.scale_dtype,
        "--dtype": args.dtype,
        "--kv-cache-dtype": args.kv_cache_dtype,
        "--verify": getattr(args, "verify", False),
    }
    given = [flag for flag, value in options.items() if value]
    if given:
        raise LlmlowerError(f"{args.model} is a compiled artifact: {', '.join(given)} apply when compiling")


def engine_config(args: argparse.Namespace, sequences: int) -> Any:
    """The serving limits from --max-num-seqs (default `sequences`, what the command runs at once: the KV pool
    is sized for that many full contexts), --max-num-batched-tokens, --max-context, --block-size, --num-blocks,
    --kv-cache-memory and --no-prefix-caching."""
    max_num_seqs = args.max_num_seqs or sequences
    return EngineConfig(
        max_num_seqs=max_num_seqs,
        # unless given, a step's budget holds one token of every sequence (--n 300: 300 sequences at once)
        max_num_batched_tokens=args.max_num_batched_tokens or max(DEFAULT_STEP_TOKENS, max_num_seqs),
        max_context=args.max_context,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        kv_cache_memory=args.kv_cache_memory,
        enable_prefix_caching=not args.no_prefix_caching,
        speculative=speculative_config(args),
    )


def speculative_config(args: argparse.Namespace) -> Any:
    """--speculative ngram|draft:PATH|self:K with --num-speculative-tokens, or None."""
    from ..runtime.speculative import SpeculativeConfig

    if args.speculative is None:
        if args.num_speculative_tokens is not None:
            raise LlmlowerError("--num-speculative-tokens needs --speculative")
        return None
    return SpeculativeConfig.parse(args.speculative, args.num_speculative_tokens or DEFAULT_SPECULATIVE_TOKENS)


def engine_from_args(args: argparse.Namespace, sequences: int) -> Any:
    """An Engine for MODEL running `sequences` at once unless --max-num-seqs says otherwise: an artifact runs as
    compiled (without torch); a model is compiled by its recipe (apply_recipe) and runs on its backend: torch, the
    reference, through the pipeline as it is captured; onnx, tvm or mlir, compiled once into the artifact cache
    (compile_cache) and loaded from there."""
    from ..runtime import Engine
    from ..runtime.artifact import is_artifact

    check_artifact_options(args)
    choice = apply_recipe(args)
    config = engine_config(args, sequences)
    adapters = lora_adapters(args)
    if is_artifact(args.model):
        return Engine.load(args.model, config, threads=args.threads, loras=adapters)
    backend = args.backend
    if backend == "torch":
        from ..api import load_engine

        pipeline = pass_pipeline(args)
        dtype = args.dtype or "float32"
        engine = load_engine(
            args.model, pipeline, dtype=dtype, config=config, verify=args.verify, kv_cache_dtype=args.kv_cache_dtype
        )
        for name, adapter in adapters.items():
            engine.load_lora(name, adapter)
        return engine

    def say(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    def open_artifact(path: Path) -> Engine:
        return Engine.load(path, config, threads=args.threads, loras=adapters)

    request = compile_request(args, backend, choice)
    return load_compiled(args.model, request, open_artifact, verify=args.verify, notify=say)


def compile_request(args: argparse.Namespace, backend: str, choice: Choice | None = None) -> CompileRequest:
    """What generate, chat and serve compile MODEL with: the pipeline flags (after apply_recipe: `choice`'s settings
    where not given), --dtype, --block-size where the backend fixes it when compiling (a paged KV layout), the
    self-draft of --speculative self:K and --kv-cache-dtype (checked against the backend before anything compiles),
    for the CPU."""
    from ..api import check_kv_cache_dtype
    from ..backends.registry import get_backend
    from ..step_io import KVLayout

    check_kv_cache_dtype(args.kv_cache_dtype, args.dtype or "float32", backend, "cpu")
    quant = args.quant or "none"
    paged = get_backend(backend).layout("cpu") is KVLayout.PAGED
    pipeline = tuple(pass_pipeline(args))
    block_size = args.block_size if paged else None
    speculative = speculative_config(args)
    drafts = (speculative.layers,) if speculative is not None and speculative.method == "self" else ()
    recipe = choice.to_dict() if choice is not None else None
    return CompileRequest(
        pipeline, quant, backend, "cpu", args.dtype, block_size, drafts, args.kv_cache_dtype, recipe=recipe
    )


def sampling_params(args: argparse.Namespace) -> Any:
    """SamplingParams from the flags given (each named after its field); invalid values name the field."""
    from ..runtime.sampling_params import SamplingParams

    given = {name: getattr(args, name) for name in SAMPLING_FLAGS if getattr(args, name) is not None}
    if "logit_bias" in given:
        try:
            given["logit_bias"] = {int(k): v for k, v in json.loads(given["logit_bias"]).items()}
        except (ValueError, AttributeError):
            raise LlmlowerError(
                f"logit_bias: expected a JSON object of token id to bias, got {args.logit_bias!r}"
            ) from None
    return SamplingParams(**given, structured_output=_structured_output(args), lora=args.lora_name)


def _structured_output(args: argparse.Namespace) -> Any:
    """--json-schema FILE, --regex or --grammar FILE as a StructuredOutput (None without them)."""
    from ..runtime.structured import StructuredOutput

    flags = {"json": args.json_schema, "regex": args.regex, "grammar": args.grammar}
    given = {k: _text_of(v) if isinstance(v, Path) else v for k, v in flags.items() if v is not None}
    return StructuredOutput(**given) if given else None


def _text_of(path: Path) -> str:
    """A text file given on the command line, or one line saying why it cannot be read."""
    try:
        return path.read_text(encoding="utf-8")
    except OSError as error:
        raise LlmlowerError(f"{path}: cannot be read ({error.strerror})") from None
    except UnicodeDecodeError as error:
        raise LlmlowerError(f"{path}: not UTF-8 text (byte {error.start}: {error.reason})") from None
