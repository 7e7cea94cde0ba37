"""Speculative decoding's speedup at batch 1: prompt lookup and the self-draft against plain decoding.

Workloads (greedy, chat template, up to --new-tokens tokens): rewrite (fix a paragraph's typos), summarise,
code edit (add type hints, rename), where the answer copies much of its prompt and prompt lookup hits; and plain
chat, where it rarely does. Each method runs every prompt of a workload `--repeats` times, one request at a time;
a workload's tokens/s is its output tokens over its wall time, median over the repeats. Acceptance: proposed
tokens accepted, and tokens emitted per verification step (accepted + 1). "same": how many outputs equal plain
decoding's token for token. Greedy speculation picks exactly the argmax of the logits it is given, but a
quantized artifact's k-row verification step rounds differently from a 1-row decode step (MatMulNBits' int8
activations), so a near tie can go the other way and the texts part there (fp32 artifacts: equal; tests).

    .venv/bin/python benchmarks/speculative.py [--model example] [--quant q4mix] [--methods ngram:4,self:8]
        [--new-tokens 128] [--repeats 3] [--threads 0] [--artifacts DIR] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from artifacts import ensure_artifact

from llmlower.frontend.example import cache_dir
from llmlower.runtime import Engine, EngineConfig, SamplingParams
from llmlower.runtime.speculative import SpeculationStats, SpeculativeConfig

PARAGRAPH = (
    "The compiler recieves a graph captured from the model and rewrites it in several pases. First it finds "
    "every attention and replace it with an op that reads a cache of keys and values, so the past tokens are not "
    "computed again. Then it fuses the normalisation with the residual add, and the three projections in one "
    "matrix multiply, wich saves memory traffic on every layer."
)
CODE = """def mean(xs):
    total = 0
    for x in xs:
        total = total + x
    return total / len(xs)


def variance(xs):
    m = mean(xs)
    total = 0
    for x in xs:
        total = total + (x - m) * (x - m)
    return total / len(xs)
"""
WORKLOADS = {
    "rewrite": [
        "Rewrite the following paragraph with its spelling mistakes fixed. Keep everything else the same."
        f"\n\n{PARAGRAPH}",
        f"Copy this text exactly, but replace the word 'compiler' with 'toolchain':\n\n{PARAGRAPH}",
    ],
    "summarise": [
        f"Summarise this paragraph in two sentences, reusing its words:\n\n{PARAGRAPH}",
        f"List the steps this paragraph describes, one per line:\n\n{PARAGRAPH}",
    ],
    "code edit": [
        f"Add Python type hints to these functions and return the whole code:\n\n```python\n{CODE}```",
        f"Rename the variable `total` to `acc` in this code and return the whole code:\n\n```python\n{CODE}```",
    ],
    "chat": [
        "What are three good habits for writing clear emails?",
        "Explain in a few sentences why the sky is blue.",
    ],
}


def run(engine: Engine, prompts: list[str], params: SamplingParams, repeats: int) -> dict:
    """Median tokens/s over repeats of serving the prompts one by one, the outputs and the acceptance."""
    rates, outputs, totals = [], [], SpeculationStats()
    for _ in range(repeats):
        tokens, started, outputs = 0, time.perf_counter(), []
        for prompt in prompts:
            result = engine.generate([prompt], params)[0]
            tokens += len(result.token_ids)
            outputs.append(result.token_ids)
        rates.append(tokens / (time.perf_counter() - started))
    if engine.stats().speculation is not None:
        totals = engine.stats().speculation
    return {"tokens_per_s": statistics.median(rates), "outputs": outputs, "speculation": totals}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="example")
    parser.add_argument("--quant", default="q4mix", help="the artifact's --quant (default q4mix)")
    parser.add_argument("--methods", default="ngram:4,self:8", help="comma-separated METHOD:TOKENS; self:K:TOKENS")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--artifacts", type=Path, default=cache_dir() / "bench" / "speculative")
    parser.add_argument("--json", type=Path, help="also write the table as JSON")
    args = parser.parse_args()

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    layers = sorted({int(m.split(":")[1]) for m in methods if m.startswith("self:")})
    directory = args.artifacts / f"{args.quant}-draft{'-'.join(map(str, layers)) or 'none'}"
    artifact = ensure_artifact(args.model, "onnx", {"quant": args.quant}, directory, draft_layers=tuple(layers))
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens)
    rows = []
    baseline: dict[str, dict] = {}
    for method in ["none", *methods]:
        speculative = None
        if method != "none":
            *spelled, tokens = method.split(":")
            speculative = SpeculativeConfig.parse(":".join(spelled), int(tokens))
        config = EngineConfig(max_num_seqs=1, max_context=1024, speculative=speculative)
        engine = Engine.load(artifact, config, threads=args.threads)
        for workload, prompts in WORKLOADS.items():
            engine.core.speculation = SpeculationStats()  # acceptance per workload
            measured = run(engine, prompts, params, args.repeats)
            if method == "none":
                baseline[workload] = measured
            pairs = list(zip(measured["outputs"], baseline[workload]["outputs"], strict=True))
            stats = measured["speculation"]
            row = {
                "method": method,
                "workload": workload,
                "tokens_per_s": round(measured["tokens_per_s"], 1),
                "speedup": round(measured["tokens_per_s"] / baseline[workload]["tokens_per_s"], 2),
                "acceptance_rate": round(stats.acceptance_rate, 3),
                "mean_accepted_length": round(stats.mean_accepted_length, 2),
                "acceptance_by_position": [round(a, 2) for a in stats.acceptance_by_position()],
                "same": f"{sum(a == b for a, b in pairs)}/{len(pairs)}",
            }
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    print(
        f"\n{args.model} {args.quant} (ONNX CPU), batch 1, greedy, {args.new_tokens} new tokens, "
        f"median of {args.repeats}\n"
    )
    print("| method | workload | tok/s | speedup | accepted | tokens/step | by position | same |")
    print("|---|---|---:|---:|---:|---:|---|---:|")
    for r in rows:
        by_position = " ".join(f"{a:.2f}" for a in r["acceptance_by_position"]) or "-"
        accepted = f"{r['acceptance_rate']:.0%}" if r["method"] != "none" else "-"
        tokens = f"{r['mean_accepted_length']:.2f}" if r["method"] != "none" else "-"
        print(
            f"| {r['method']} | {r['workload']} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f}x | {accepted} | "
            f"{tokens} | {by_position} | {r['same']} |"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
