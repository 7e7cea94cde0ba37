"""Narrow KV caches against the float32 one, on the example model (or --model): quality and speed in one run.

Quality: sliding-window perplexity at a 2,048-token window (--window) of a text the scales were not calibrated
on (tests/data/perplexity.txt by default), for the float32 cache, a float16 one (where the backend's kernels read
it) and the int8 cache at each --headroom.
Speed: --streams sequences of --context prompt tokens each, all admitted at once; after every prompt is
prefilled, the decode steps of --new-tokens tokens each are timed (output tokens/s, median of --repeats).
Each row names its KV bytes per token. CPU artifacts of each of --backends (onnx: per-sequence caches,
GroupQueryAttention; tvm: paged pools, llmlower's kernels), compiled once into --artifacts and reused.

    .venv/bin/python benchmarks/kv_cache.py [--model example] [--quant q4mix] [--backends onnx,tvm]
        [--caches float32,float16,int8] [--window 2048] [--headroom 1.25] [--streams 16] [--context 2048]
        [--new-tokens 32] [--repeats 3] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from shaped_speed import machine

from llmlower.api import compile_artifact, text_perplexity, tokenizer_of
from llmlower.backends.registry import get_backend
from llmlower.frontend import load, resolve_model
from llmlower.frontend.calibration import calibration_ids
from llmlower.frontend.example import cache_dir
from llmlower.passes import build_pipeline
from llmlower.roofline import machine_ceilings
from llmlower.runtime import Engine, SamplingParams
from llmlower.runtime.artifact import kv_cache_dtype, read_manifest
from llmlower.spec import ModelSpec

ROOT = Path(__file__).resolve().parent.parent


def compiled(model: str, backend: str, quant: str, cache: str, headroom: float, directory: Path, rebuild: bool) -> Path:
    """MODEL compiled for `backend` on the CPU with every position's logits (perplexity needs them), its cache in
    `cache` (float32, float16, or int8 at `headroom`); reused when present."""
    name = f"{backend}-{quant}-{ {'float32': 'float', 'float16': 'float16'}.get(cache, f'int8-h{headroom:g}') }"
    out = directory / name
    if (out / "manifest.json").exists() and not rebuild:
        return out
    pipeline = build_pipeline(quant=quant, all_logits=True)
    if cache == "float16":
        pipeline.append(("kv_cache_dtype", {"dtype": "float16"}))
    elif cache == "int8":
        ids = calibration_ids(tokenizer_of(load(resolve_model(model))))
        pipeline.append(("kv_cache_dtype", {"calibration": ids, "headroom": headroom}))
    print(f"[kv_cache] compiling {name} into {out}", file=sys.stderr)
    shutil.rmtree(out, ignore_errors=True)
    return compile_artifact(model, out, pipeline, backend=backend)


def decode_speed(artifact: Path, streams: int, context: int, new_tokens: int, threads: int) -> float:
    """Output tokens/s of the steps that decode all `streams` sequences and nothing else, once their prompts of
    `context` tokens are prefilled (one prompt per step; each sequence runs long enough for `new_tokens` such
    steps)."""
    total = streams + new_tokens  # the first sequence decodes while the later prompts are prefilled
    engine = Engine.load(
        artifact, max_context=context + total, max_num_seqs=streams, max_num_batched_tokens=context, threads=threads
    )
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0, max_tokens=total, ignore_eos=True)
    for _ in range(streams):
        engine.add_request(rng.integers(5, engine.spec.vocab_size, context).tolist(), params)
    tokens, seconds, all_decoding = 0, 0.0, False
    while engine.has_unfinished():
        started = time.perf_counter()
        deltas = engine.step()
        if all_decoding and len(deltas) == streams:  # the step before had every prompt done: no prefill in this one
            tokens, seconds = tokens + streams, seconds + time.perf_counter() - started
        all_decoding = len(deltas) == streams
    return tokens / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="example")
    parser.add_argument("--quant", default="q4mix", help="weights (default q4mix, the recommended pipeline)")
    parser.add_argument("--backends", default="onnx,tvm", help="comma-separated: onnx (slots), tvm (paged)")
    parser.add_argument("--text", type=Path, default=ROOT / "tests" / "data" / "perplexity.txt")
    parser.add_argument("--caches", default="float32,float16,int8", help="comma-separated: float32, float16, int8")
    parser.add_argument("--window", type=int, default=2048)
    parser.add_argument("--headroom", default="1.25", help="int8 variants: calibrated peak x headroom")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--context", type=int, default=2048, help="prompt tokens of each stream")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--artifacts", type=Path, default=cache_dir() / "bench" / "kv_cache")
    parser.add_argument("--rebuild", action="store_true")
    parser.add_argument("--no-speed", action="store_true", help="perplexity only")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()

    text = args.text.read_text(encoding="utf-8")
    headrooms = [float(h) for h in args.headroom.split(",")]
    caches = args.caches.split(",")
    variants = [(c, h) for c in caches for h in (headrooms if c == "int8" else [0.0])]
    artifacts = {
        (backend, cache, h): compiled(args.model, backend, args.quant, cache, h, args.artifacts, args.rebuild)
        for backend in args.backends.split(",")
        for cache, h in variants
        if cache == "float32" or cache in get_backend(backend).kv_cache_dtypes.get("cpu", ())
    }
    rows = []
    for (backend, cache, headroom), artifact in artifacts.items():
        result, _ = text_perplexity(artifact, text, [], window=args.window)
        manifest = read_manifest(artifact, verify=False)
        per_token = ModelSpec.from_dict(manifest["spec"]).kv_bytes_per_token(kv_cache_dtype(manifest))
        row = {
            "backend": backend,
            "cache": f"int8 (headroom {headroom:g})" if cache == "int8" else cache,
            "kv_bytes_per_token": per_token,
            "perplexity": result.perplexity,
            "tokens_scored": result.tokens,
        }
        if not args.no_speed and (cache != "int8" or headroom == headrooms[-1]):
            speeds = [
                decode_speed(artifact, args.streams, args.context, args.new_tokens, args.threads)
                for _ in range(args.repeats)
            ]
            row["decode_tokens_per_s"] = statistics.median(speeds)
        rows.append(row)
        print(json.dumps(row), file=sys.stderr)
    base = {row["backend"]: row["perplexity"] for row in rows if row["cache"] == "float32"}
    print(
        f"{args.model} {args.quant}, CPU artifacts, {args.threads} threads; {machine(machine_ceilings('cpu'))}; "
        f"perplexity of {args.text.name} at a {args.window}-token window; decode of {args.streams} streams after "
        f"prompts of {args.context} tokens, {args.new_tokens} new tokens each"
    )
    print(f"| backend | cache | KV bytes/token | perplexity | vs float | {args.streams}-stream decode tok/s |")
    print("|---|---|---:|---:|---:|---:|")
    for row in rows:
        speed = f"{row['decode_tokens_per_s']:.1f}" if "decode_tokens_per_s" in row else "–"
        change = 100 * (row["perplexity"] / base[row["backend"]] - 1)
        cells = [row["backend"], row["cache"], f"{row['kv_bytes_per_token']:,}", f"{row['perplexity']:.4f}"]
        print("| " + " | ".join([*cells, f"{change:+.2f}%", speed]) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
