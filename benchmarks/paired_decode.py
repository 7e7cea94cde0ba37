"""Batch-1 decode of several artifacts, alternated in one process: paired ratios for before/after comparisons.

On a shared machine one artifact's speed can drift by 2x between runs minutes apart. Here the artifacts take turns,
one generation each per round, so a slow moment hits a round's every artifact alike; the figure is the median over
rounds of each artifact's tokens/s over the first's in that round.

    .venv/bin/python benchmarks/paired_decode.py BEFORE AFTER [...] [--rounds 12] [--new-tokens 96] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from llmlower.runtime import Engine, EngineConfig, SamplingParams

PROMPT = "Write a short story about a compiler that"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifacts", type=Path, nargs="+")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=0, help="0: each engine's default, one per core")
    args = parser.parse_args()
    config = EngineConfig(max_num_seqs=1, max_context=512)
    engines = [Engine.load(path, config, threads=args.threads) for path in args.artifacts]
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    rates: list[list[float]] = [[] for _ in engines]
    for round_ in range(args.rounds):
        for engine, rate in zip(engines, rates, strict=True):
            [result] = engine.generate([PROMPT], params)
            rate.append(result.timing.decode_tokens_per_s)
        print(f"round {round_ + 1}: " + ", ".join(f"{rate[-1]:.1f}" for rate in rates), flush=True)
    print(f"batch-1 decode, {args.new_tokens} tokens, {args.rounds} rounds")
    print("| artifact | median tok/s | paired ratio to the first (median) |\n|---|---:|---:|")
    for path, rate in zip(args.artifacts, rates, strict=True):
        ratio = statistics.median(x / first for x, first in zip(rate, rates[0], strict=True))
        print(f"| {path} | {statistics.median(rate):.1f} | {ratio:.3f} |")


if __name__ == "__main__":
    main()
