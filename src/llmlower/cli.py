"""The `llmlower` command: generate, chat, compile, perplexity, inspect, passes, roofline."""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

from rich.console import Console

from . import progress
from .backends.registry import BACKENDS
from .compile_cache import RECOMMENDED_BACKEND, RECOMMENDED_QUANT, CompileRequest, load_compiled
from .errors import LlmlowerError
from .runtime import EngineConfig
from .serve.limits import RequestLimits, limit_flags
from .step_io import KV_CACHE_DTYPES

VERIFY_HELP = (
    "check each pass numerically against the one before, then the built artifact, run by its own runtime, against "
    "the torch reference (refused beyond its backend's tolerance)"
)
MODEL_HELP = "a checkpoint directory, a .gguf file, 'example' (SmolLM2-135M-Instruct) or (generate) an artifact"


class RichReporter:
    """Shows each stage as a spinner while it runs and a line with its time when it is done (stderr)."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self._status = None

    def start(self, description: str) -> None:
        if self._status is None and self.console.is_terminal:
            self._status = self.console.status(description)
            self._status.start()

    def finish(self, description: str, seconds: float, detail: str) -> None:
        if self._status is not None:
            self._status.stop()
            self._status = None
        suffix = f" [dim]{detail}[/dim]" if detail else ""
        self.console.print(f"[green]✓[/green] {description} ({seconds:.1f}s){suffix}", highlight=False)


def _pipeline(args: argparse.Namespace, all_logits: bool = False, default_quant: str = "none") -> list:
    """The pass list the pipeline flags ask for (`default_quant` unless --quant)."""
    from .passes import build_pipeline

    quant = args.quant or default_quant
    return build_pipeline(
        args.passes, quant, args.keep, args.quant_embedding, all_logits=all_logits, lm_head_bits=args.lm_head_bits
    )


def _check_artifact_options(args: argparse.Namespace) -> None:
    """An artifact was compiled with its pipeline and dtype: options that would change them are an error."""
    from .runtime.artifact import is_artifact

    if not is_artifact(args.model):
        return
    options = {
        "--backend": getattr(args, "backend", None),
        "--passes": args.passes,
        "--quant": args.quant not in (None, "none"),
        "--keep": args.keep,
        "--quant-embedding": args.quant_embedding,
        "--lm-head-bits": args.lm_head_bits,
        "--dtype": args.dtype,
        "--kv-cache-dtype": args.kv_cache_dtype != "auto",
        "--verify": getattr(args, "verify", False),
    }
    given = [flag for flag, value in options.items() if value]
    if given:
        raise LlmlowerError(f"{args.model} is a compiled artifact: {', '.join(given)} apply when compiling")


def _engine_config(args: argparse.Namespace, sequences: int) -> Any:
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
        speculative=_speculative(args),
    )


def _speculative(args: argparse.Namespace) -> Any:
    """--speculative ngram|draft:PATH|self:K with --num-speculative-tokens, or None."""
    from .runtime.speculative import SpeculativeConfig

    if args.speculative is None:
        if args.num_speculative_tokens is not None:
            raise LlmlowerError("--num-speculative-tokens needs --speculative")
        return None
    return SpeculativeConfig.parse(args.speculative, args.num_speculative_tokens or DEFAULT_SPECULATIVE_TOKENS)


def _engine(args: argparse.Namespace, sequences: int, backend: str = "torch") -> Any:
    """An Engine for MODEL running `sequences` at once unless --max-num-seqs says otherwise: an artifact runs as
    compiled (without torch); a model runs on `backend`: torch, the reference, through the pipeline as it is
    captured; onnx or tvm, compiled once into the artifact cache (compile_cache) and loaded from there."""
    from .runtime import Engine
    from .runtime.artifact import is_artifact

    _check_artifact_options(args)
    config = _engine_config(args, sequences)
    if is_artifact(args.model):
        return Engine.load(args.model, config, threads=args.threads)
    if backend == "torch":
        from .api import load_engine

        pipeline = _pipeline(args)
        dtype = args.dtype or "float32"
        return load_engine(
            args.model, pipeline, dtype=dtype, config=config, verify=args.verify, kv_cache_dtype=args.kv_cache_dtype
        )

    def say(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    def open_artifact(path: Path) -> Engine:
        return Engine.load(path, config, threads=args.threads)

    return load_compiled(args.model, _compile_request(args, backend), open_artifact, verify=args.verify, notify=say)


def _compile_request(args: argparse.Namespace, backend: str) -> CompileRequest:
    """What generate, chat and serve compile MODEL with: the pipeline flags (--quant RECOMMENDED_QUANT unless
    given), --dtype, --block-size where the backend fixes it when compiling (a paged KV layout), the self-draft of
    --speculative self:K and --kv-cache-dtype, for the CPU."""
    from .backends.registry import get_backend
    from .step_io import KVLayout

    quant = args.quant or RECOMMENDED_QUANT
    paged = get_backend(backend).layout("cpu") is KVLayout.PAGED
    pipeline = tuple(_pipeline(args, default_quant=quant))
    block_size = args.block_size if paged else None
    speculative = _speculative(args)
    drafts = (speculative.layers,) if speculative is not None and speculative.method == "self" else ()
    return CompileRequest(pipeline, quant, backend, "cpu", args.dtype, block_size, drafts, args.kv_cache_dtype)


def parse_dims(text: str) -> dict[str, int]:
    """Named sizes: NAME=SIZE, comma-separated (batch=1,tokens=16)."""
    dims = {}
    for part in text.split(","):
        name, _, size = part.partition("=")
        if not name.strip() or not size.strip().isdigit():
            raise argparse.ArgumentTypeError(f"expected NAME=SIZE,... like batch=1,tokens=16, got {text!r}")
        dims[name.strip()] = int(size)
    return dims


def parse_bytes(text: str) -> int:
    """A size in bytes: a number with an optional K, M, G (powers of 1024; KiB, MB, ... read the same)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if match is None:
        raise argparse.ArgumentTypeError(f"expected a size like 2G, 512M or 1073741824, got {text!r}")
    number, unit = match.groups()
    return int(float(number) * 1024 ** "BKMG".index(unit.upper() or "B"))


def parse_port(text: str) -> int:
    """A TCP port, 1-65535."""
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"expected a TCP port, 1-65535, got {text!r}")
    return int(text)


def _sampling_params(args: argparse.Namespace) -> Any:
    """SamplingParams from the flags given (each named after its field); invalid values name the field."""
    from .runtime.sampling import SamplingParams

    given = {name: getattr(args, name) for name in SAMPLING_FLAGS if getattr(args, name) is not None}
    if "logit_bias" in given:
        try:
            given["logit_bias"] = {int(k): v for k, v in json.loads(given["logit_bias"]).items()}
        except (ValueError, AttributeError):
            raise LlmlowerError(
                f"logit_bias: expected a JSON object of token id to bias, got {args.logit_bias!r}"
            ) from None
    return SamplingParams(**given, structured_output=_structured_output(args))


def _structured_output(args: argparse.Namespace) -> Any:
    """--json-schema FILE, --regex or --grammar FILE as a StructuredOutput (None without them)."""
    from .runtime.structured import StructuredOutput

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


def _generate(args: argparse.Namespace) -> int:
    params = _sampling_params(args)  # bad values fail before the model loads
    engine = _engine(args, sequences=params.n, backend=args.backend or RECOMMENDED_BACKEND)
    if args.stream:
        for delta in engine.stream([args.prompt], params, chat=not args.raw):
            print(delta.text, end="\n\n" if delta.finish_reason and params.n > 1 else "", flush=True)
        print()
        return 0
    results = engine.generate([args.prompt], params, chat=not args.raw)
    if args.json:
        payloads = [result.to_dict() for result in results]
        print(json.dumps(payloads[0] if len(payloads) == 1 else payloads, ensure_ascii=False))
        return 0
    err = Console(stderr=True)
    for result in results:
        print(result.text)
        err.print(
            f"[dim]{len(result.token_ids)} tokens, finish_reason={result.finish_reason}, "
            f"TTFT {result.timing.ttft_s * 1000:.0f} ms, decode {result.timing.decode_tokens_per_s:.1f} tokens/s"
            + _speculation_summary(result.speculation)
            + "[/dim]"
        )
    return 0


def _speculation_summary(speculation: dict[str, Any] | None) -> str:
    if not speculation:
        return ""
    return (
        f", speculation: {speculation['accepted_tokens']}/{speculation['proposed_tokens']} proposed tokens accepted, "
        f"{speculation['mean_accepted_length']:.2f} tokens per step"
    )


def _chat(args: argparse.Namespace) -> int:
    """An interactive chat in the terminal: each reply streams as it is generated; /reset, /exit."""
    from dataclasses import replace

    params = _sampling_params(args)
    if params.n != 1:
        raise LlmlowerError("chat: n must be 1")
    engine = _engine(args, sequences=1, backend=args.backend or RECOMMENDED_BACKEND)
    console = Console(stderr=True)
    console.print(f"[dim]chatting with {args.model} ({'greedy' if params.greedy else 'sampling'}); /reset, /exit[/dim]")
    messages = [{"role": "system", "content": args.system}] if args.system else []
    turn = 0
    while True:
        try:
            line = input("> ")
        except EOFError:
            return 0
        if line.strip() == "/exit":
            return 0
        if line.strip() == "/reset":
            messages = messages[:1] if args.system else []
            continue
        messages.append({"role": "user", "content": line})
        reply = []
        seeded = replace(params, seed=None if params.seed is None else params.seed + turn)
        for delta in engine.stream([messages], seeded):
            print(delta.text, end="", flush=True)
            reply.append(delta.text)
        print()
        messages.append({"role": "assistant", "content": "".join(reply)})
        turn += 1


SERVE_SEQUENCES = 16  # the server's max_num_seqs unless --max-num-seqs
LIMIT_FLAGS = limit_flags()  # serve's per-request limits: (name, default, help)
DEFAULT_STEP_TOKENS = EngineConfig.max_num_batched_tokens
DEFAULT_SPECULATIVE_TOKENS = 4


def _serve(args: argparse.Namespace) -> int:
    """Load the model (an artifact needs no torch), then serve it until SIGTERM."""
    import os
    from pathlib import Path

    try:
        from .serve import ServerConfig, run
    except ImportError as error:
        raise LlmlowerError(f"serve needs the serve extra (pip install 'llmlower[serve]'): {error}") from None
    name = args.served_model_name or Path(str(args.model).rstrip("/")).name
    api_key = args.api_key or os.environ.get("LLMLOWER_API_KEY")
    limits = RequestLimits(**{flag: getattr(args, flag) for flag, _, _ in LIMIT_FLAGS})
    config = ServerConfig(name, api_key, args.max_waiting, args.max_body_bytes, limits, args.request_timeout or None)
    if args.replicas > 1:
        try:
            from .serve.replicas import run_replicas
        except ImportError as error:
            message = f"--replicas needs the replicas extra (pip install 'llmlower[replicas]'): {error}"
            raise LlmlowerError(message) from None
        options = {"host": args.host, "port": args.port, "threads": args.threads, "drain_timeout": args.drain_timeout}
        run_replicas(args.model, _engine_config(args, SERVE_SEQUENCES), config, args.replicas, **options)
        return 0
    engine = _engine(args, sequences=SERVE_SEQUENCES)
    run(engine, config, host=args.host, port=args.port, drain_timeout=args.drain_timeout)
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from .frontend import load, resolve_model

    loaded = load(resolve_model(args.model), dtype=args.dtype)
    spec = loaded.spec
    report = {
        "source": str(loaded.source),
        "spec": {k: v for k, v in spec.to_dict().items() if k != "chat_template"},
        "has_chat_template": spec.chat_template is not None,
        "parameters": loaded.num_parameters,
        "kv_cache": {
            "bytes_per_token": spec.kv_bytes_per_token(),
            "formula": f"2 x {spec.num_layers} layers x {spec.num_kv_heads} kv_heads x {spec.head_dim} head_dim "
            f"x {spec.dtype_bytes} bytes ({spec.dtype})",
            "context": args.context,
            "batch": args.batch,
            "bytes": spec.kv_cache_bytes(args.context, args.batch),
        },
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    console = Console()
    console.print(f"[bold]{spec.architecture}[/bold] from {loaded.source}")
    for key, value in report["spec"].items():
        console.print(f"  {key:<20} {value}", highlight=False)
    console.print(f"  {'parameters':<20} {loaded.num_parameters:,}")
    kv = report["kv_cache"]
    console.print(f"KV cache: {kv['bytes_per_token']:,} bytes per token = {kv['formula']}")
    total = f"{kv['bytes']:,} bytes ({kv['bytes'] / 2**20:.1f} MiB)"
    console.print(f"          {total} for context {args.context} x batch {args.batch}")
    return 0


def _compile(args: argparse.Namespace) -> int:
    from .api import compile_artifact
    from .runtime.artifact import read_manifest
    from .runtime.executors.mlir import runs_here

    out = compile_artifact(
        args.model,
        args.output,
        _pipeline(args),
        backend=args.backend,
        target=args.target,
        dtype=args.dtype,
        accuracy_level=args.accuracy_level,
        cuda_arch=args.cuda_arch,
        cpu=args.cpu,
        dialect=args.dialect,
        static_dims=args.static_dims,
        block_size=args.block_size,
        verify=args.verify,
        draft_layers=args.draft_layers,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    manifest = read_manifest(out, verify=False)
    size = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    console = Console()
    console.print(f"[bold]{out}[/bold]: {size / 2**20:.1f} MiB, {manifest['backend']} / {manifest['target']}")
    console.print("pipeline: " + ", ".join(step["name"] for step in manifest["pipeline"]), highlight=False)
    for entry in manifest.get("drafts", {}).values():
        draft = out / entry["path"]
        draft_size = sum(p.stat().st_size for p in draft.iterdir() if p.is_file())
        layers = f"{entry['layers']} of {manifest['spec']['num_layers']} decoder layers"
        console.print(f"self-draft: {draft} ({layers}, {draft_size / 2**20:.1f} MiB)", highlight=False)
    if manifest["backend"] == "mlir" and not runs_here(manifest):
        step = manifest["entry_points"]["step"]
        console.print(f"{step['file']}: function @{step['function']} for an MLIR compiler", highlight=False)
    else:
        console.print(f'run it:   llmlower generate {out} --prompt "Hello"', highlight=False)
    return 0


def _perplexity(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .api import text_perplexity

    path = Path(args.text)
    if not path.is_file():
        raise LlmlowerError(f"{path}: --text file not found")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise LlmlowerError(f"{path}: --text is not UTF-8 text ({error})") from None
    _check_artifact_options(args)
    pipeline = _pipeline(args, all_logits=True)
    dtype, kv_cache_dtype = args.dtype or "float32", args.kv_cache_dtype
    result, history = text_perplexity(
        args.model, text, pipeline, dtype=dtype, window=args.window, stride=args.stride, kv_cache_dtype=kv_cache_dtype
    )
    weight_bytes = history[-1]["stats"]["parameter_bytes"] if history else None
    report = {"perplexity": result.perplexity, "tokens": result.tokens, "weight_bytes": weight_bytes}
    if args.json:
        print(json.dumps(report))
    else:
        names = ", ".join(step["name"] for step in history)
        print(f"perplexity {result.perplexity:.3f} over {result.tokens} tokens ({names})")
        if weight_bytes is not None:
            print(f"weights {weight_bytes / 2**20:.1f} MiB")
        quant = history[-1]["stats"] if history and history[-1]["name"] == "quantize_weights" else None
        if quant is not None:
            before, after = quant["quantized_weight_bytes_before"], quant["quantized_weight_bytes_after"]
            print(f"quantized weights {before / 2**20:.1f} MiB -> {after / 2**20:.1f} MiB ({after / before:.3f}x)")
    return 0


def _roofline(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .roofline import machine_ceilings
    from .roofline.report import summary_table, write_report
    from .roofline.study import StudyOptions, parse_batches, parse_pipelines, run_artifact_study, run_study
    from .runtime.artifact import is_artifact

    options = StudyOptions(
        prefill=args.prefill,
        batches=parse_batches(args.batch),
        context=args.context,
        backend=args.backend or "onnx",
        repeats=args.repeats,
        measure=not args.no_measure,
    )
    if is_artifact(args.model):
        given = [flag for flag, value in (("--pipelines", args.pipelines), ("--backend", args.backend)) if value]
        if given:
            raise LlmlowerError(f"{args.model} is a compiled artifact: {', '.join(given)} come from its manifest")
        ceilings = machine_ceilings(args.machine, remeasure=args.remeasure)
        report = run_artifact_study(Path(args.model), args.checkpoint, options, ceilings)
    else:
        pipelines = args.pipelines or "baseline;fusion;fusion+q8;fusion+q4g32"
        parse_pipelines(pipelines)  # bad words fail before measuring or loading anything
        ceilings = machine_ceilings(args.machine, remeasure=args.remeasure)
        report = run_study(args.model, pipelines, options, ceilings, dtype=args.dtype)
    path = write_report(report, Path(args.output))
    print("\n".join(summary_table(report)))
    print(f"\n{path} (+ report.json, roofline.png, time_by_kind.png)")
    return 0


def _passes(args: argparse.Namespace) -> int:
    from .passes import DEFAULT_PIPELINE, PASSES

    if args.explain not in (None, "all") and args.explain not in PASSES:
        raise LlmlowerError(f"--explain: unknown pass {args.explain!r} (registered: {', '.join(PASSES)})")
    for name, p in PASSES.items():
        if args.explain not in (None, "all", name):
            continue
        default = " (default)" if name in DEFAULT_PIPELINE else ""
        print(f"{name:<18} {p.summary}{default}")
        if args.explain:
            print(f"{'':<18} {p.explain}\n")
    return 0


def _add_pipeline_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--passes", help="comma-separated passes (default: the default pipeline; see `passes`)")
    parser.add_argument(
        "--quant",
        help="weight quantization: none, q8, q4g32, q4g64, q4g128 (add -sym: symmetric, -zp4: 4-bit zero points), "
        "q4mix (int4 where it keeps quality, int8 elsewhere); default none "
        f"(generate and chat compiling a model: {RECOMMENDED_QUANT})",
    )
    parser.add_argument(
        "--keep", action="append", default=[], help="keep in full precision: lm_head or a weight-name substring"
    )
    parser.add_argument("--quant-embedding", action="store_true", help="also quantize the embedding table")
    parser.add_argument("--lm-head-bits", type=int, choices=[4, 8], help="LM head under --quant (default 8)")
    parser.add_argument(
        "--dtype", choices=["float32", "float16", "bfloat16"], help="default float32 (compile for cuda: float16)"
    )
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=KV_CACHE_DTYPES,
        help="auto: the model's dtype; int8: a quarter of float32's KV bytes, scales per kv head and channel "
        "calibrated when compiling (onnx, tvm, mlir and torch on the cpu)",
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


def _add_engine_options(parser: argparse.ArgumentParser) -> None:
    """--backend, the sampling flags (named after SamplingParams' fields), then the serving and pipeline options."""
    parser.add_argument(
        "--backend",
        choices=list(BACKENDS),
        help=f"what runs MODEL: {RECOMMENDED_BACKEND} (default), tvm or mlir (linalg, JIT-compiled: slow), compiled "
        "once and cached under $LLMLOWER_CACHE/artifacts (default ~/.cache/llmlower); torch, the reference (not "
        "compiled)",
    )
    group = parser.add_argument_group("sampling (see llmlower.runtime.sampling.SamplingParams)")
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
    _add_serving_options(parser, "the completions asked for")


def _add_serving_options(parser: argparse.ArgumentParser, default_seqs: str) -> None:
    """Context, the engine's serving limits, threads and the pipeline options."""
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
    parser.add_argument("--threads", type=int, default=0, help="artifact: intra-op threads (default: one per core)")
    parser.add_argument("--verify", action="store_true", help=VERIFY_HELP)
    _add_pipeline_options(parser)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmlower", description="Compile and run Transformer LLMs.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate a completion for one prompt (greedy unless --temperature)")
    gen.add_argument("model", help=MODEL_HELP)
    gen.add_argument("--prompt", required=True, help="the user message (or raw text with --raw)")
    gen.add_argument("--raw", action="store_true", help="do not apply the model's chat template")
    gen.add_argument("--stream", action="store_true", help="print the text as it is generated")
    gen.add_argument(
        "--json", action="store_true", help="print the result as JSON (text, ids, logprobs, usage, timing)"
    )
    _add_engine_options(gen)
    gen.set_defaults(run=_generate)

    chat = sub.add_parser("chat", help="an interactive chat in the terminal, replies streamed")
    chat.add_argument("model", help=MODEL_HELP)
    chat.add_argument("--system", help="a system message to start the conversation with")
    _add_engine_options(chat)
    chat.set_defaults(run=_chat)

    comp = sub.add_parser("compile", help="compile a model into a deployable artifact directory")
    comp.add_argument("model", help=MODEL_HELP)
    comp.add_argument("-o", "--output", required=True, help="the artifact directory to write")
    compilers = [name for name, backend in BACKENDS.items() if backend.compiler]
    comp.add_argument(
        "--backend",
        default="onnx",
        choices=compilers,
        help="onnx: ONNX Runtime; tvm: Apache TVM; mlir: MLIR through torch-mlir (for other MLIR compilers)",
    )
    comp.add_argument("--target", default="cpu", help="cpu or cuda")
    comp.add_argument(
        "--accuracy-level",
        type=int,
        choices=range(5),
        help="onnx: MatMulNBits compute type on CPU: 4 = int8 activations (default, fastest), 0 = float32",
    )
    comp.add_argument("--cuda-arch", help="tvm, cuda: GPU architecture to build for (sm_80 default, sm_89, sm_90)")
    comp.add_argument("--cpu", help="tvm, cpu: LLVM CPU name to build for (default: this machine's, e.g. znver3)")
    comp.add_argument("--dialect", help="mlir: the dialect of the module: torch, linalg (default), stablehlo, tosa")
    comp.add_argument(
        "--static-dims",
        type=parse_dims,
        metavar="NAME=SIZE,...",
        help="mlir: fix dimensions of the step (batch, tokens, context), e.g. batch=1,tokens=16; tosa has no dynamic "
        "sizes and fixes a decode step unless told (batch=1,tokens=1,context=the model's)",
    )
    comp.add_argument("--block-size", type=int, help="KV block size of a paged artifact (tvm, onnx cuda; default 16)")
    comp.add_argument("--verify", action="store_true", help=VERIFY_HELP)
    comp.add_argument(
        "--draft-layers",
        type=int,
        action="append",
        metavar="K",
        help="also compile a self-draft for speculative decoding: the model's first K decoder layers + final norm "
        "+ LM head, same pipeline and KV layout, into OUTPUT/draft-layers-K (repeatable)",
    )
    _add_pipeline_options(comp)
    comp.set_defaults(run=_compile)

    ppl = sub.add_parser("perplexity", help="sliding-window perplexity of a text file under a pipeline")
    ppl.add_argument("model", help=MODEL_HELP)
    ppl.add_argument("--text", required=True, help="a UTF-8 text file")
    ppl.add_argument("--window", type=int, default=512, help="tokens per window (default 512)")
    ppl.add_argument("--stride", type=int, help="tokens the window advances (default: half the window)")
    ppl.add_argument("--json", action="store_true", help='print {"perplexity", "tokens", "weight_bytes"}')
    _add_pipeline_options(ppl)
    ppl.set_defaults(run=_perplexity)

    ins = sub.add_parser("inspect", help="show a model's spec, parameter count and KV-cache size")
    ins.add_argument("model", help=MODEL_HELP)
    ins.add_argument("--context", type=int, default=4096, help="context length for the KV-cache total")
    ins.add_argument("--batch", type=int, default=1, help="batch size for the KV-cache total")
    ins.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    ins.add_argument("--json", action="store_true")
    ins.set_defaults(run=_inspect)

    roof = sub.add_parser("roofline", help="FLOPs, bytes and step times of pass pipelines against the roofline")
    roof.add_argument("model", help=MODEL_HELP + " (an artifact: its own pipeline, needs --checkpoint)")
    roof.add_argument("-o", "--output", required=True, help="directory for report.md, report.json and the PNGs")
    roof.add_argument(
        "--pipelines",
        help="';'-separated: baseline (canonicalize + kv_cache), fusion (the default pipeline), WORD+QUANT "
        "(e.g. fusion+q4g32); default 'baseline;fusion;fusion+q8;fusion+q4g32'",
    )
    roof.add_argument("--prefill", type=int, default=512, help="prompt tokens of the prefill step (default 512)")
    roof.add_argument("--batch", default="1,16", help="decode batch sizes, comma-separated (default 1,16)")
    roof.add_argument("--context", type=int, default=512, help="cache positions a decode step attends (default 512)")
    roof.add_argument("--backend", choices=list(BACKENDS), help="where steps are timed (default onnx)")
    roof.add_argument(
        "--machine", default="cpu", help="ceilings: cpu or cuda (measured here), a100, h100, h200, l4, rtx4090"
    )
    roof.add_argument("--remeasure", action="store_true", help="measure the ceilings again, not from the cache")
    roof.add_argument("--repeats", type=int, default=5, help="timed runs per step, after a warm-up (default 5)")
    roof.add_argument("--no-measure", action="store_true", help="costs and predictions only, no step times")
    roof.add_argument("--checkpoint", help="for an artifact MODEL: the checkpoint it was compiled from")
    roof.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    roof.set_defaults(run=_roofline)

    srv = sub.add_parser(
        "serve",
        help="an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions); an artifact is code that "
        "runs in the server (TVM's model.so, MLIR modules): serve only artifacts you trust",
    )
    srv.add_argument("model", help=MODEL_HELP)
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    srv.add_argument("--port", type=parse_port, default=8000, help="TCP port, 1-65535 (default 8000)")
    srv.add_argument("--api-key", help="clients must send 'Authorization: Bearer KEY' (default: $LLMLOWER_API_KEY)")
    srv.add_argument("--served-model-name", help="the model's name in the API (default: the artifact's directory name)")
    srv.add_argument("--max-waiting", type=int, default=256, help="sequences waiting before new requests get 429")
    srv.add_argument("--max-body-bytes", type=parse_bytes, default=4 << 20, help="larger request bodies get 413")
    srv.add_argument("--drain-timeout", type=int, default=30, help="seconds running requests get after SIGTERM")
    srv.add_argument(
        "--request-timeout",
        type=float,
        default=600,
        help="seconds a request may run before it is aborted (0: no limit; default 600)",
    )
    for flag, default, what in LIMIT_FLAGS:
        srv.add_argument(f"--{flag.replace('_', '-')}", type=int, default=default, help=f"{what} (default {default})")
    srv.add_argument(
        "--replicas", type=int, default=1, help="N replicas on Ray Serve, each its own engine (artifacts; RAY_ADDRESS)"
    )
    _add_serving_options(srv, f"{SERVE_SEQUENCES}")
    srv.set_defaults(run=_serve)

    lst = sub.add_parser("passes", help="list the registered passes")
    lst.add_argument(
        "--explain", nargs="?", const="all", metavar="NAME", help="say what a pass (or every pass) matches and rewrites"
    )
    lst.set_defaults(run=_passes)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    lowest = {
        "replicas": 1,
        "max_waiting": 0,
        "max_body_bytes": 1,
        "drain_timeout": 0,
        "request_timeout": 0,
        **{flag: 1 if flag == "max_n" else 0 for flag, _, _ in LIMIT_FLAGS},
        "max_context": 1,
        "max_num_seqs": 1,
        "max_num_batched_tokens": 1,
        "block_size": 1,
        "num_blocks": 1,
        "kv_cache_memory": 1,
        "context": 1,
        "batch": 1,
        "window": 1,
        "stride": 1,
        "threads": 0,
        "prefill": 1,
        "repeats": 1,
    }
    for name, bound in lowest.items():
        value = getattr(args, name, None)
        if isinstance(value, int | float) and value < bound:
            print(f"error: --{name.replace('_', '-')} must be >= {bound}, got {value}", file=sys.stderr)
            return 2
    progress.use_reporter(RichReporter(Console(stderr=True)))
    try:
        return args.run(args)
    except LlmlowerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        progress.use_reporter(None)


if __name__ == "__main__":
    sys.exit(main())
