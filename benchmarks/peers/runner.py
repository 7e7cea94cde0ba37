"""What both peer runners share: their command line, the prompts file, the repeat loop and the JSON line.

Standard library only, so each runner imports it from its own virtual environment (it sits beside them).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

BF16_FLAGS = {"avx512_bf16", "amx_bf16"}
OFFLINE_REQUESTS, OFFLINE_PROMPT, OFFLINE_NEW = 16, 100, 128  # vLLM's offline workload: prompts all at once
OFFLINE = f"offline_{OFFLINE_REQUESTS}_tokens_per_s"


def offline_prompts(prompts: dict[int, list[int]]) -> list[list[int]]:
    """OFFLINE_REQUESTS prompts of OFFLINE_PROMPT tokens, each a different cut of the longest prompt."""
    source = prompts[max(prompts)] * 2
    return [source[i * 7 : i * 7 + OFFLINE_PROMPT] for i in range(OFFLINE_REQUESTS)]


def without_amx_environment() -> dict[str, str]:
    """This process's environment for a peer run as on a CPU without AMX tiles (see without_amx/sitecustomize.py)."""
    folder = str(Path(__file__).parent / "without_amx")
    path = os.pathsep.join(p for p in (folder, os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}


def native_dtype() -> str:
    """vLLM's dtype on this CPU: bfloat16 where its flags (/proc/cpuinfo) include a bf16 instruction set, else
    float32 (vLLM's bf16 kernels emulate it without one: SmolLM2 on an AVX2-only EPYC decoded 26 tokens/s at
    batch 1 in bf16)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = {flag for line in f if line.startswith("flags") for flag in line.split(":", 1)[1].split()}
    except OSError:
        flags = set()
    return "bfloat16" if flags & BF16_FLAGS else "float32"


def parse(description: str, model_help: str) -> tuple[argparse.Namespace, dict[int, list[int]]]:
    """The runner's arguments and its prompts: {prompt length: token ids} from --prompts."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model", required=True, help=model_help)
    parser.add_argument("--prompts", required=True, help='JSON {"13": [ids], "512": [ids]}')
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    with open(args.prompts) as f:
        return args, {int(n): ids for n, ids in json.load(f).items()}


def report(
    name: str,
    engine: str,
    version: str,
    prompts: dict[int, list[int]],
    args: argparse.Namespace,
    prefill_time: Callable[[list[int]], float],
    decode_speed: Callable[[list[int], int], float],
    extra: dict[str, float] | None = None,
) -> None:
    """Each repeat times every prompt's prefill, then the decode after the shortest prompt and after the longest, as
    benchmarks/speed.py does; prints the medians (and `extra` figures of the runner's own) as one JSON line
    (progress on stderr)."""
    ttft: dict[int, list[float]] = {n: [] for n in prompts}
    speeds, long_speeds = [], []
    for repeat in range(args.repeats):
        for n, ids in prompts.items():
            ttft[n].append(prefill_time(ids))
        speeds.append(decode_speed(prompts[min(prompts)], args.new_tokens))
        long_speeds.append(decode_speed(prompts[max(prompts)], args.new_tokens))
        after_longest = f"{long_speeds[-1]:.1f} after the longest prompt"
        print(f"[{name}] repeat {repeat}: {speeds[-1]:.1f} tok/s ({after_longest})", file=sys.stderr)
    row = {
        "decode_tokens_per_s": statistics.median(speeds),
        "decode_long_tokens_per_s": statistics.median(long_speeds),
        "decode_long_context": max(prompts),
        **{f"ttft_{n}_s": statistics.median(times) for n, times in ttft.items()},
        "engine": engine,
        "version": version,
        **(extra or {}),
    }
    print(json.dumps(row))
