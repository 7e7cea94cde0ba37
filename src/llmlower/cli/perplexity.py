"""`llmlower perplexity`: sliding-window perplexity of a text file under a pass pipeline."""

from __future__ import annotations

import argparse
import json

from ..errors import LlmlowerError
from .engine_args import apply_recipe, check_artifact_options, pass_pipeline
from .options import MODEL_HELP, add_pipeline_options


def add_perplexity_parser(sub: argparse._SubParsersAction) -> None:
    """The `perplexity` command and its options."""
    ppl = sub.add_parser("perplexity", help="sliding-window perplexity of a text file under a pipeline")
    ppl.add_argument("model", help=MODEL_HELP)
    ppl.add_argument("--text", required=True, help="a UTF-8 text file")
    ppl.add_argument("--window", type=int, default=512, help="tokens per window (default 512)")
    ppl.add_argument("--stride", type=int, help="tokens the window advances (default: half the window)")
    ppl.add_argument("--json", action="store_true", help='print {"perplexity", "tokens", "weight_bytes"}')
    ppl.add_argument(
        "--decode",
        action="store_true",
        help="score one token per step, as generation runs (any artifact; kernels that take another path at one "
        "row); slower",
    )
    add_pipeline_options(ppl, recipe_default=None)
    ppl.set_defaults(run=_perplexity)


def _perplexity(args: argparse.Namespace) -> int:
    """Print the --text file's perplexity under the pipeline (and the weights' size)."""
    from pathlib import Path

    from ..api import text_perplexity

    path = Path(args.text)
    if not path.is_file():
        raise LlmlowerError(f"{path}: --text file not found")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise LlmlowerError(f"{path}: --text is not UTF-8 text ({error})") from None
    check_artifact_options(args)
    apply_recipe(args)  # --recipe: its quantization and KV cache dtype, on the torch reference (not its kernels)
    pipeline = pass_pipeline(args, all_logits=True)
    dtype, kv_cache_dtype = args.dtype or "float32", args.kv_cache_dtype
    result, history = text_perplexity(
        args.model,
        text,
        pipeline,
        dtype=dtype,
        window=args.window,
        stride=args.stride,
        kv_cache_dtype=kv_cache_dtype,
        decode=args.decode,
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
        quant = history[-1]["stats"] if history else {}
        if "quantized_weight_bytes_before" in quant:
            before, after = quant["quantized_weight_bytes_before"], quant["quantized_weight_bytes_after"]
            print(f"quantized weights {before / 2**20:.1f} MiB -> {after / 2**20:.1f} MiB ({after / before:.3f}x)")
    return 0
