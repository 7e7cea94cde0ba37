"""`llmlower inspect` (a model's spec, parameter count and KV-cache size) and `llmlower passes` (the registered
passes)."""

from __future__ import annotations

import argparse
import json

from rich.console import Console

from ..errors import LlmlowerError
from .options import MODEL_HELP


def add_inspect_parser(sub: argparse._SubParsersAction) -> None:
    """The `inspect` command and its options."""
    ins = sub.add_parser(
        "inspect",
        help="show a model's spec, parameter count and KV-cache size; an artifact's recipe, backend and pipeline too",
    )
    ins.add_argument("model", help=MODEL_HELP)
    ins.add_argument("--context", type=int, default=4096, help="context length for the KV-cache total")
    ins.add_argument("--batch", type=int, default=1, help="batch size for the KV-cache total")
    ins.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    ins.add_argument("--json", action="store_true")
    ins.set_defaults(run=_inspect)


def add_passes_parser(sub: argparse._SubParsersAction) -> None:
    """The `passes` command and its options."""
    lst = sub.add_parser("passes", help="list the registered passes")
    lst.add_argument(
        "--explain", nargs="?", const="all", metavar="NAME", help="say what a pass (or every pass) matches and rewrites"
    )
    lst.set_defaults(run=_passes)


def _inspect(args: argparse.Namespace) -> int:
    """Print a model's spec, parameter count and KV-cache size (as JSON with --json); for an artifact, what it was
    compiled with (read from its manifest: no torch)."""
    from ..runtime.artifact import is_artifact

    if is_artifact(args.model):
        return _inspect_artifact(args)
    from ..frontend import load, resolve_model

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


def _passes(args: argparse.Namespace) -> int:
    """List the registered passes (with --explain, what they match and rewrite)."""
    from ..passes import DEFAULT_PIPELINE, PASSES

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


LORA_FIELDS = ("max_loras", "rank", "targets")  # the lora pass's stats that describe an artifact's adapter slots


def _inspect_artifact(args: argparse.Namespace) -> int:
    """Print what an artifact was compiled with: recipe (and why), backend, target, dtype, pipeline, LoRA adapter
    slots, spec."""
    from ..runtime.artifact import read_manifest
    from ..spec import ModelSpec

    manifest = read_manifest(args.model, verify=False)
    spec = ModelSpec.from_dict(manifest["spec"])
    report = {
        "artifact": str(args.model),
        "recipe": manifest.get("recipe"),
        "backend": manifest["backend"],
        "target": manifest["target"],
        "dtype": manifest["dtype"],
        "pipeline": [step["name"] for step in manifest["pipeline"]],
        "compile_seconds": {step["name"]: round(step["seconds"], 1) for step in manifest["pipeline"]},
        "lora": next(
            (
                {key: step["stats"][key] for key in LORA_FIELDS}
                for step in manifest["pipeline"]
                if step["name"] == "lora"
            ),
            None,
        ),
        "spec": {k: v for k, v in spec.to_dict().items() if k != "chat_template"},
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    console = Console()
    recipe = report["recipe"]
    console.print(f"[bold]{args.model}[/bold]: {report['backend']} / {report['target']}, {report['dtype']}")
    if recipe is None:
        console.print("recipe: none (compiled with the flags alone)", highlight=False)
    else:
        asked = f" (asked: {recipe['asked']})" if recipe["asked"] != recipe["recipe"] else ""
        console.print(f"recipe: {recipe['recipe']}{asked}: {recipe['reason']}", highlight=False)
        settings = ", ".join(f"{k}={v}" for k, v in recipe["settings"].items() if v not in (None, False))
        console.print(f"        {settings}", highlight=False)
    console.print("pipeline: " + ", ".join(report["pipeline"]), highlight=False)
    if report["lora"] is not None:
        lora = report["lora"]
        console.print(
            f"LoRA: {lora['max_loras']} adapter slots of rank {lora['rank']} on {lora['targets']} linears",
            highlight=False,
        )
    for key, value in report["spec"].items():
        console.print(f"  {key:<20} {value}", highlight=False)
    return 0
