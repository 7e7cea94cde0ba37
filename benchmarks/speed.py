"""Decode speed and time to first token, measured in one run for every engine in the table.

Rows: transformers eager (its own forward with a DynamicCache) and llmlower's torch reference backend,
both fp32 on the same weights and the same token sequences. Decode: batch 1, N new tokens (greedy, EOS
ignored), tokens/s as the median over repeats. TTFT: prefill of a 13-token and a 512-token prompt, median.

    .venv/bin/python benchmarks/speed.py [--model example] [--new-tokens 128] [--repeats 3] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
from transformers import DynamicCache

from llmlower.api import compile_program
from llmlower.backends.torch import TorchExecutor
from llmlower.runtime import StepBatch, Tokenizer

PROMPT_TOKENS = (13, 512)
FILLER = (
    "Compilers for language models capture a graph, rewrite it with passes and lower it to kernels. "
    "The runtime keeps a cache of keys and values so that each new token reads the past once. "
)

Prefill = Callable[[list[int]], np.ndarray]
Decode = Callable[[int, int], np.ndarray]  # (token, position) -> logits


def transformers_eager(module: torch.nn.Module) -> tuple[Prefill, Decode]:
    state: dict[str, DynamicCache] = {}

    @torch.no_grad()
    def prefill(ids: list[int]) -> np.ndarray:
        state["cache"] = DynamicCache()
        out = module(input_ids=torch.tensor([ids]), past_key_values=state["cache"], use_cache=True)
        return out.logits[0, -1].numpy()

    @torch.no_grad()
    def decode(token: int, position: int) -> np.ndarray:
        out = module(input_ids=torch.tensor([[token]]), past_key_values=state["cache"], use_cache=True)
        return out.logits[0, -1].numpy()

    return prefill, decode


def llmlower_executor(executor: TorchExecutor) -> tuple[Prefill, Decode]:
    def prefill(ids: list[int]) -> np.ndarray:
        return executor.step(StepBatch([0], [ids], [0]))[0]

    def decode(token: int, position: int) -> np.ndarray:
        return executor.step(StepBatch([0], [[token]], [position]))[0]

    return prefill, decode


def measure(prefill: Prefill, decode: Decode, prompts: dict[int, list[int]], new_tokens: int, repeats: int) -> dict:
    ttft = {n: [] for n in prompts}
    speeds = []
    for _ in range(repeats):
        for n, ids in prompts.items():
            started = time.perf_counter()
            prefill(ids)
            ttft[n].append(time.perf_counter() - started)
        ids = prompts[PROMPT_TOKENS[0]]
        token = int(prefill(ids).argmax())
        started = time.perf_counter()
        for step in range(new_tokens - 1):
            token = int(decode(token, len(ids) + step).argmax())
        speeds.append((new_tokens - 1) / (time.perf_counter() - started))
    return {
        "decode_tokens_per_s": statistics.median(speeds),
        **{f"ttft_{n}_s": statistics.median(times) for n, times in ttft.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="example")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="also write the table to this file")
    args = parser.parse_args()

    loaded, program = compile_program(args.model)
    files = loaded.tokenizer
    tokenizer = Tokenizer(files.tokenizer_json, files.config, files.chat_template)
    filler = tokenizer.encode(FILLER * 64, add_special_tokens=False)
    prompts = {n: filler[:n] for n in PROMPT_TOKENS}
    context = max(PROMPT_TOKENS) + args.new_tokens + 1

    engines = {
        "transformers eager fp32": transformers_eager(loaded.module),
        "llmlower torch fp32": llmlower_executor(TorchExecutor(program, max_batch=1, max_context=context)),
    }
    rows = {}
    for name, (prefill, decode) in engines.items():
        rows[name] = measure(prefill, decode, prompts, args.new_tokens, args.repeats)
    baseline = rows["transformers eager fp32"]["decode_tokens_per_s"]

    print(f"{torch.get_num_threads()} threads, batch 1, {args.new_tokens} new tokens, median of {args.repeats}")
    print(f"{'engine':<26} {'decode tok/s':>12} {'vs eager':>9} {'TTFT 13 ms':>11} {'TTFT 512 ms':>12}")
    for name, row in rows.items():
        print(
            f"{name:<26} {row['decode_tokens_per_s']:>12.1f} {row['decode_tokens_per_s'] / baseline:>8.2f}x "
            f"{row['ttft_13_s'] * 1000:>11.0f} {row['ttft_512_s'] * 1000:>12.0f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
