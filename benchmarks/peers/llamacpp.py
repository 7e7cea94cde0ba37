"""Decode speed and TTFT of llama.cpp (llama-cpp-python) on token prompts; prints one JSON line (see README.md).

.venv-llamacpp/bin/python llamacpp.py --model FILE.gguf --prompts P.json [--new-tokens N] [--repeats N] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import llama_cpp
import numpy as np
from llama_cpp import Llama


def last_logits(llm: Llama) -> np.ndarray:
    """The logits of the last evaluated position, as a view on llama.cpp's buffer."""
    return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),))


def prefill(llm: Llama, ids: list[int]) -> np.ndarray:
    """Evaluate ids on an empty KV cache (eval drops every cell past n_tokens, here 0) and return the last logits."""
    llm.reset()
    llm.eval(ids)
    return last_logits(llm)


def prefill_time(llm: Llama, ids: list[int]) -> float:
    """Seconds to prefill ids from an empty cache and get the logits of the last position."""
    started = time.perf_counter()
    prefill(llm, ids)
    return time.perf_counter() - started


def decode_speed(llm: Llama, ids: list[int], new_tokens: int) -> float:
    """Tokens/s of the new_tokens - 1 greedy steps (argmax, EOS ignored) that follow the prefill of ids."""
    token = int(prefill(llm, ids).argmax())
    started = time.perf_counter()
    for _ in range(new_tokens - 1):
        llm.eval([token])
        token = int(last_logits(llm).argmax())
    elapsed = time.perf_counter() - started
    assert llm.n_tokens == len(ids) + new_tokens - 1, llm.n_tokens
    return (new_tokens - 1) / elapsed


def main() -> None:
    """Parse the arguments, measure, print the JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="GGUF file")
    parser.add_argument("--prompts", required=True, help='JSON {"13": [ids], "512": [ids]}')
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    with open(args.prompts) as f:
        prompts = {int(n): ids for n, ids in json.load(f).items()}
    longest = max(len(ids) for ids in prompts.values())
    batch = max(512, longest)  # the longest prompt goes through in one batch
    llm = Llama(
        args.model,
        n_ctx=longest + args.new_tokens,
        n_batch=batch,
        n_ubatch=batch,
        n_threads=args.threads,
        n_threads_batch=args.threads,
        verbose=False,
    )  # flash_attn off, f16 KV cache: llama-cpp-python's defaults
    print(f"[llamacpp] {llama_cpp.llama_print_system_info().decode().strip()}", file=sys.stderr)

    ttft: dict[int, list[float]] = {n: [] for n in prompts}
    speeds = []
    for repeat in range(args.repeats):
        for n, ids in prompts.items():
            ttft[n].append(prefill_time(llm, ids))
        speeds.append(decode_speed(llm, prompts[min(prompts)], args.new_tokens))
        print(f"[llamacpp] repeat {repeat}: {speeds[-1]:.1f} tok/s", file=sys.stderr)
    print(
        json.dumps(
            {
                "decode_tokens_per_s": statistics.median(speeds),
                **{f"ttft_{n}_s": statistics.median(times) for n, times in ttft.items()},
                "engine": "llama.cpp (llama-cpp-python)",
                "version": llama_cpp.__version__,
            }
        )
    )


if __name__ == "__main__":
    main()
