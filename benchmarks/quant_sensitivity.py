"""How much perplexity each projection kind loses at int4: the measurement `--quant q4mix` was chosen from.

Every linear is quantized to the base scheme (q8 by default), then each projection kind alone (weights whose name
contains it) to the probe scheme (q4g32-zp4: 4-bit zero points, what MatMulNBits takes natively) and the LM head
alone (lm_head_bits 4 under a q4g32 base); each row is the perplexity of --text under that pipeline (torch
reference, sliding window) and its change against fp32. The named mixes (q4mix) are measured too.

    .venv/bin/python benchmarks/quant_sensitivity.py [--model example] [--text tests/data/perplexity.txt]
        [--kinds q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from llmlower.api import text_perplexity
from llmlower.passes import build_pipeline, parse_quant
from llmlower.passes.manager import PassSpec

KINDS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
GROUPS = {"q/k/v": ("q_proj", "k_proj", "v_proj"), "gate/up": ("gate_proj", "up_proj")}  # fused by the pipeline


def with_overrides(quant: str, names: tuple[str, ...], probe: str) -> list[PassSpec]:
    """The default pipeline (every position's logits) with `quant`, and `probe` for weights named like `names`."""
    pipeline = build_pipeline(quant=quant, all_logits=True)
    name, options = pipeline[-1]
    overrides = [[n, parse_quant(probe)] for n in names]
    return [*pipeline[:-1], (name, {**options, "overrides": overrides})]


def rows(kinds: list[str], base: str, probe: str) -> dict[str, list[PassSpec]]:
    """Row label -> pipeline: fp32, the base, each kind (fused groups together) at the probe, the mixes."""
    grouped: list[tuple[str, tuple[str, ...]]] = []
    for kind in kinds:
        group = next(((label, names) for label, names in GROUPS.items() if kind in names), (kind, (kind,)))
        if group not in grouped:
            grouped.append(group)
    table = {"fp32": build_pipeline(all_logits=True), base: build_pipeline(quant=base, all_logits=True)}
    for label, names in grouped:
        table[f"{base}, {label} {probe}"] = with_overrides(base, names, probe)
    table["q4g32, LM head int4 (sym)"] = build_pipeline(quant="q4g32", lm_head_bits=4, all_logits=True)
    table["q4mix"] = build_pipeline(quant="q4mix", all_logits=True)
    return table


def measure(model: str | Path, text: str, table: dict[str, list[PassSpec]], tag: str) -> dict[str, dict[str, Any]]:
    """Each row's perplexity of `text` under `model` compiled with its pipeline (torch reference), and the bytes of
    the weights the pipeline quantized (None when it quantizes nothing)."""
    results: dict[str, dict[str, Any]] = {}
    for label, pipeline in table.items():
        print(f"[{tag}] {label}", file=sys.stderr, flush=True)
        result, history = text_perplexity(model, text, pipeline)
        stats = history[-1]["stats"]
        results[label] = {"perplexity": result.perplexity, "weight_bytes": stats.get("quantized_weight_bytes_after")}
    return results


def print_table(results: dict[str, dict[str, Any]], title: str, reference: str, size_column: str) -> None:
    """The rows as a markdown table, each perplexity also as a change against row `reference`'s."""
    base = results[reference]["perplexity"]
    print(title)
    print(f"| pipeline | perplexity | vs {reference} | {size_column} |\n|---|---:|---:|---:|")
    for label, row in results.items():
        size = f"{row['weight_bytes'] / 1e6:.1f}" if row["weight_bytes"] else "-"
        print(f"| {label} | {row['perplexity']:.2f} | {row['perplexity'] / base - 1:+.1%} | {size} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="example")
    parser.add_argument("--text", type=Path, default=Path(__file__).parent.parent / "tests/data/perplexity.txt")
    parser.add_argument("--kinds", default=KINDS, help="comma-separated weight-name substrings")
    parser.add_argument("--base", default="q8", help="the scheme of every other weight")
    parser.add_argument("--probe", default="q4g32-zp4", help="the scheme each kind is tried at")
    parser.add_argument("--json", type=Path, help="also write the rows to this file")
    args = parser.parse_args()
    text = args.text.read_text(encoding="utf-8")
    results = measure(args.model, text, rows(args.kinds.split(","), args.base, args.probe), "sensitivity")
    title = f"perplexity of {args.text.name} ({args.model}); linear-layer weight bytes after quantization"
    print_table(results, title, "fp32", "linear weight MB")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
