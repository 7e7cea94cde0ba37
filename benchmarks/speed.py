"""Decode speed and time to first token, measured in one run for every engine in the table.

Rows: transformers eager (its own forward with a DynamicCache, fp32), llmlower's torch reference backend
(fp32), llmlower ONNX artifacts (fp32, q8, q4g32) and TVM CPU artifacts (fp32, q4g32), compiled once into
--artifacts and reused, and the peers of benchmarks/peers/ (ONNX Runtime GenAI int4, llama.cpp on the
example's Q4_1 GGUF) where their setup.sh has been run. Same token sequences everywhere. Decode: batch 1,
N new tokens (greedy, EOS ignored), tokens/s as the median over repeats. TTFT: prefill of a 13-token and a
512-token prompt, median.

    .venv/bin/python benchmarks/speed.py [--model example] [--new-tokens 128] [--repeats 3] [--threads N]
        [--artifacts DIR] [--only NAME,...] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from artifacts import ensure_artifact
from transformers import DynamicCache

from llmlower.api import compile_program, tokenizer_of
from llmlower.backends.torch import TorchExecutor
from llmlower.frontend.example import cache_dir
from llmlower.runtime import Engine, Executor, StepBatch, sequential_block_tables

PEERS = Path(__file__).parent / "peers"
# row -> (artifact directory name, build_pipeline options). The last row reads what onnxruntime-genai's
# int4 model reads per token (symmetric int4, int4 LM head): the same bytes, at its perplexity cost.
ARTIFACTS = {  # row -> (directory under --artifacts, backend, build_pipeline options)
    "onnx fp32": ("none", "onnx", {}),
    "onnx q8": ("q8", "onnx", {"quant": "q8"}),
    "onnx q4g32": ("q4g32", "onnx", {"quant": "q4g32"}),
    "onnx q4g32-sym int4 head": ("q4g32-sym-head4", "onnx", {"quant": "q4g32-sym", "lm_head_bits": 4}),
    "tvm fp32": ("tvm-none", "tvm", {}),
    "tvm q4g32": ("tvm-q4g32", "tvm", {"quant": "q4g32"}),
}
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


def llmlower_executor(executor: Executor) -> tuple[Prefill, Decode]:
    """One sequence in the first blocks of the executor's KV cache."""
    tables = sequential_block_tables(executor, [executor.max_context])

    def prefill(ids: list[int]) -> np.ndarray:
        return executor.step(StepBatch([ids], [0], tables))[0]

    def decode(token: int, position: int) -> np.ndarray:
        return executor.step(StepBatch([[token]], [position], tables))[0]

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


def artifact(
    model: str, backend: str, options: dict, directory: Path, threads: int, context: int, rebuild: bool
) -> tuple[Prefill, Decode]:
    """A `backend` artifact of MODEL with build_pipeline `options`, compiled into `directory` unless it is there."""
    ensure_artifact(model, backend, options, directory, rebuild)
    return llmlower_executor(Engine.load(directory, max_num_seqs=1, max_context=context, threads=threads).executor)


def peer(name: str, model: Path, prompts: dict[int, list[int]], new_tokens: int, repeats: int, threads: int) -> dict:
    """Run benchmarks/peers/NAME.py in its own virtual environment; its JSON line is the row."""
    python = PEERS / f".venv-{name}" / "bin" / "python"
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump({str(n): ids for n, ids in prompts.items()}, f)
        f.flush()
        command = [str(python), str(PEERS / f"{name}.py"), "--model", str(model), "--prompts", f.name]
        command += ["--new-tokens", str(new_tokens), "--repeats", str(repeats), "--threads", str(threads)]
        done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{name}.py failed ({done.returncode}):\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def peer_models() -> dict[str, tuple[str, Path]]:
    """Peer rows whose setup.sh has been run: row name -> (runner, model path)."""
    cache = cache_dir()
    candidates = {
        "onnxruntime-genai int4": ("ortgenai", cache / "peers" / "ortgenai-int4"),
        "llama.cpp Q4_1": ("llamacpp", cache / "smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"),
    }
    return {
        row: (runner, path)
        for row, (runner, path) in candidates.items()
        if (PEERS / f".venv-{runner}" / "bin" / "python").exists() and path.exists()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="example")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--artifacts", type=Path, help="where the artifacts are compiled and reused")
    parser.add_argument("--rebuild", action="store_true", help="compile the artifacts even if present")
    parser.add_argument("--only", help="comma-separated row names to run (default: all)")
    parser.add_argument("--json", help="also write the table to this file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    artifacts = args.artifacts or cache_dir() / "bench" / Path(args.model).name

    loaded, program = compile_program(args.model)
    filler = tokenizer_of(loaded).encode(FILLER * 64, add_special_tokens=False)
    prompts = {n: filler[:n] for n in PROMPT_TOKENS}
    context = max(PROMPT_TOKENS) + args.new_tokens + 1

    engines: dict[str, Callable[[], tuple[Prefill, Decode]]] = {
        "transformers eager fp32": lambda: transformers_eager(loaded.module),
        "llmlower torch fp32": lambda: llmlower_executor(TorchExecutor(program, max_context=context)),
    }
    for row, (name, backend, options) in ARTIFACTS.items():
        engines[row] = lambda b=backend, o=options, d=artifacts / name: artifact(
            args.model, b, o, d, args.threads, context, args.rebuild
        )
    peers = peer_models() if args.model == "example" else {}
    wanted = set(args.only.split(",")) if args.only else set(engines) | set(peers)
    rows = {}
    for name, make in engines.items():
        if name in wanted:
            print(f"[speed] {name}", file=sys.stderr)
            rows[name] = measure(*make(), prompts, args.new_tokens, args.repeats)
    for name, (runner, path) in peers.items():
        if name in wanted:
            print(f"[speed] {name}", file=sys.stderr)
            rows[name] = peer(runner, path, prompts, args.new_tokens, args.repeats, args.threads)
    print_table(rows, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


def print_table(rows: dict[str, dict], args: argparse.Namespace) -> None:
    """Rows with decode tok/s, its ratio to the first row, and TTFT in ms."""
    baseline_name = next(iter(rows))
    baseline = rows[baseline_name]["decode_tokens_per_s"]
    print(f"{args.threads} threads, batch 1, {args.new_tokens} new tokens, median of {args.repeats}")
    print(f"{'engine':<26} {'decode tok/s':>12} {'vs first':>9} {'TTFT 13 ms':>11} {'TTFT 512 ms':>12}")
    for name, row in rows.items():
        print(
            f"{name:<26} {row['decode_tokens_per_s']:>12.1f} {row['decode_tokens_per_s'] / baseline:>8.2f}x "
            f"{row['ttft_13_s'] * 1000:>11.0f} {row['ttft_512_s'] * 1000:>12.0f}"
        )
    ours, theirs = rows.get("onnx q4g32"), rows.get("onnxruntime-genai int4")
    if ours and theirs:
        print(
            f"onnx q4g32 vs onnxruntime-genai int4: {ours['decode_tokens_per_s'] / theirs['decode_tokens_per_s']:.2f}x"
        )


if __name__ == "__main__":
    main()
