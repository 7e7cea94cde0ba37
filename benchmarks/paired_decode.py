"""Decode of several artifacts, alternated in one process: paired ratios for before/after comparisons.

On a shared machine one artifact's speed can drift by 2x between runs minutes apart. Here the artifacts take turns,
one generation each per round, so a slow moment hits a round's every artifact alike; the figure is the median over
rounds of each artifact's rate over the first's in that round. One stream (the default): a short prompt, tokens/s
of its decode. --streams N: N prompts of --prompt-tokens random token ids (new ones each round, so the prefix cache
finds nothing), generated together: the time until every stream has its first token (the prompts' prefill), and
output tokens/s over the whole generation.

    .venv/bin/python benchmarks/paired_decode.py BEFORE AFTER [...] [--rounds 12] [--new-tokens 96] [--threads N]
        [--streams 1] [--prompt-tokens 100]
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import numpy as np

from llmlower.runtime import Engine, EngineConfig, SamplingParams

PROMPT = "Write a short story about a compiler that"


def generation(engine: Engine, prompts: list, params: SamplingParams) -> tuple[float, float]:
    """(seconds until every stream's first token, output tokens/s): one stream's decode rate when alone."""
    results = engine.generate(prompts, params)
    if len(results) == 1:
        return results[0].timing.ttft_s, results[0].timing.decode_tokens_per_s
    tokens = sum(len(result.token_ids) for result in results)
    return max(r.timing.ttft_s for r in results), tokens / max(r.timing.total_s for r in results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifacts", type=Path, nargs="+")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=0, help="0: each engine's default, one per core")
    parser.add_argument("--streams", type=int, default=1)
    parser.add_argument("--prompt-tokens", type=int, default=100, help="each stream's prompt, with --streams > 1")
    args = parser.parse_args()
    config = EngineConfig(max_num_seqs=args.streams, max_context=max(512, args.prompt_tokens + args.new_tokens))
    engines = [Engine.load(path, config, threads=args.threads) for path in args.artifacts]
    vocab = engines[0].tokenizer.vocab_size
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    rng = np.random.default_rng(0)
    firsts: list[list[float]] = [[] for _ in engines]
    rates: list[list[float]] = [[] for _ in engines]
    for round_ in range(args.rounds):
        prompts = (
            [PROMPT] if args.streams == 1 else rng.integers(100, vocab, (args.streams, args.prompt_tokens)).tolist()
        )
        for engine, first, rate in zip(engines, firsts, rates, strict=True):
            seconds, tokens_per_s = generation(engine, prompts, params)
            first.append(seconds)
            rate.append(tokens_per_s)
        cells = [f"{rate[-1]:.1f} tok/s ({first[-1]:.2f} s)" for first, rate in zip(firsts, rates, strict=True)]
        print(f"round {round_ + 1}: " + ", ".join(cells), flush=True)
    what = "batch-1 decode" if args.streams == 1 else f"{args.streams} streams of {args.prompt_tokens} prompt tokens"
    print(f"{what}, {args.new_tokens} tokens, {args.rounds} rounds")
    print("| artifact | median tok/s | paired ratio to the first (median) | first tokens by (median s) |")
    print("|---|---:|---:|---:|")
    for path, first, rate in zip(args.artifacts, firsts, rates, strict=True):
        ratio = statistics.median(x / y for x, y in zip(rate, rates[0], strict=True))
        print(f"| {path} | {statistics.median(rate):.1f} | {ratio:.3f} | {statistics.median(first):.2f} |")


if __name__ == "__main__":
    main()
