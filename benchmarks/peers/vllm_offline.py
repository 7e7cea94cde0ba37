"""Decode speed, TTFT and offline throughput of vLLM's CPU build on token prompts; prints one JSON line (see
docs/benchmarks.md). Offline: OFFLINE_REQUESTS prompts of OFFLINE_PROMPT tokens (cut from the longest prompt), all
submitted at once, OFFLINE_NEW greedy tokens each: output tokens / wall time, the median over repeats. In
runner.native_dtype(): bf16 only where the CPU computes it. Prefix caching off: every repeat prefills its prompts
again (with it on, vLLM's default, a repeated prompt's TTFT is a cache hit).

.venv-vllm/bin/python vllm_offline.py --model CHECKPOINT --prompts P.json [--new-tokens N] [--repeats N] [--threads N]
"""

from __future__ import annotations

import os
import statistics
import time

from runner import OFFLINE, OFFLINE_NEW, OFFLINE_PROMPT, OFFLINE_REQUESTS, native_dtype, offline_prompts, parse, report


def main() -> None:
    args, prompts = parse(__doc__.splitlines()[0], "checkpoint directory")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")  # GiB of KV cache
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{args.threads - 1}")
    from vllm import LLM, SamplingParams, TokensPrompt, __version__

    longest = max(len(ids) for ids in prompts.values())
    dtype = native_dtype()
    context = max(longest, OFFLINE_PROMPT) + OFFLINE_NEW + 8
    llm = LLM(args.model, dtype=dtype, max_model_len=context, seed=0, enable_prefix_caching=False)

    def run(batch: list[list[int]], new_tokens: int) -> float:
        """Seconds to generate `new_tokens` greedy tokens (EOS ignored) for every prompt of `batch` at once."""
        params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
        started = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in batch], params, use_tqdm=False)
        return time.perf_counter() - started

    def decode_speed(ids: list[int], new_tokens: int) -> float:
        """(new_tokens - 1) / (time of new_tokens - time of 1): the decode after the prefill."""
        return (new_tokens - 1) / (run([ids], new_tokens) - run([ids], 1))

    offline = offline_prompts(prompts)
    run(offline, 2)  # warm-up
    speeds = [OFFLINE_REQUESTS * OFFLINE_NEW / run(offline, OFFLINE_NEW) for _ in range(args.repeats)]
    extra = {OFFLINE: statistics.median(speeds), "dtype": dtype}
    report("vllm", f"vLLM CPU ({dtype})", __version__, prompts, args, lambda ids: run([ids], 1), decode_speed, extra)


if __name__ == "__main__":
    main()
