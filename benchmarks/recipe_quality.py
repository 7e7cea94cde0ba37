"""Held-out quality of each named recipe, as `auto` needs it: every recipe in llmlower.recipes compiled into an
artifact (its own backend and settings) and scored one token a step (`llmlower perplexity ARTIFACT --decode`), on
the text recipes were chosen on (tests/data/heldout.txt) and on one nobody tuned on (tests/data/unseen.txt), against
fp32's perplexity from the torch reference. The figures go into each recipe's `quality` in llmlower/recipes.py.

    .venv/bin/python benchmarks/recipe_quality.py [--model example] [--recipes fast,portable] [--out DIR]
        [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from llmlower.api import compile_model, text_perplexity
from llmlower.passes import build_pipeline
from llmlower.recipes import QUALITY_TEXTS, RECIPES

DATA = Path(__file__).resolve().parent.parent / "tests" / "data"
WINDOW = 512


def score(model: str | Path, text: str, decode: bool) -> float:
    """Perplexity of `text`: an artifact one token a step (decode), or MODEL in fp32 on the torch reference."""
    pipeline = build_pipeline(None, "none", all_logits=True)
    result, _ = text_perplexity(model, text, pipeline, window=WINDOW, decode=decode)
    return result.perplexity


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="example")
    parser.add_argument("--recipes", default=",".join(name for name in RECIPES if name != "exact"))
    parser.add_argument("--out", type=Path, default=Path("/tmp/recipe-quality"), help="where the artifacts go")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    texts = {name: (DATA / f"{name}.txt").read_text(encoding="utf-8") for name in QUALITY_TEXTS}
    fp32 = {name: score(args.model, text, decode=False) for name, text in texts.items()}
    rows = []
    for name in args.recipes.split(","):
        artifact = args.out / name
        started = time.perf_counter()
        if not artifact.exists():
            compile_model(args.model, artifact, recipe=name)
        row = {"recipe": name, "flags": RECIPES[name].flags, "compile_s": round(time.perf_counter() - started, 1)}
        for text_name, text in texts.items():
            ppl = score(artifact, text, decode=True)
            row[text_name] = {"perplexity": round(ppl, 3), "over_fp32_pct": round(100 * (ppl / fp32[text_name] - 1), 1)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    print("\nfp32: " + ", ".join(f"{k} {v:.3f}" for k, v in fp32.items()))
    print("| recipe | " + " | ".join(QUALITY_TEXTS) + " |\n|---|" + "---:|" * len(QUALITY_TEXTS))
    for row in rows:
        cells = [f"{row[t]['perplexity']:.2f} (+{row[t]['over_fp32_pct']}%)" for t in QUALITY_TEXTS]
        print(f"| {row['recipe']} | " + " | ".join(cells) + " |")
    if args.json:
        args.json.write_text(json.dumps({"fp32": fp32, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
