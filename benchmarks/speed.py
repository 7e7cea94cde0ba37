"""Decode speed and time to first token, measured in one run for every engine in the table.

Rows: transformers eager (its own forward with a DynamicCache, fp32), llmlower's torch reference backend
(fp32), llmlower ONNX artifacts (fp32, q8, q4g32, q4mix, q4mix-a8, ...) and TVM CPU artifacts (fp32, q4g32,
q4mix, q4g32-sym with an int4 head, with float32 and float16 scales), compiled once into --artifacts and reused,
and the peers of benchmarks/peers/ (ONNX Runtime GenAI int4, llama.cpp on the example's Q4_1 GGUF) where their
setup.sh has been run. Same token
sequences everywhere. Decode: batch 1,
N new tokens (greedy, EOS ignored), tokens/s as the median over repeats. TTFT: prefill of a 13-token and a
512-token prompt, median. With --rounds N every row is measured N times, the rows taking turns (each round in the
order opposite to the one before: a shared VM drifts within minutes); each figure is then the median over the rounds
and "vs GenAI" the median of the rounds' ratios.

Each row's bandwidth roof: the bytes one decoded token reads (weights + the KV cache at the decode's mean
context; llmlower rows from the roofline cost model on the row's own pipeline, peers from their model files)
against this machine's measured memory bandwidth (llmlower.roofline.ceilings, cached; --remeasure).

    .venv/bin/python benchmarks/speed.py [--model example] [--new-tokens 128] [--repeats 3] [--threads N]
        [--rounds 1] [--artifacts DIR] [--only NAME,...] [--json FILE] [--remeasure]
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import onnx
import torch
from artifacts import ensure_artifact
from transformers import DynamicCache

from llmlower.api import tokenizer_of
from llmlower.backends.torch.program_executor import TorchExecutor
from llmlower.frontend import capture, load, resolve_model
from llmlower.frontend.example import cache_dir
from llmlower.ir.program import Program
from llmlower.passes import DEFAULT_PIPELINE, run_pipeline
from llmlower.recipes import RECIPES, Recipe
from llmlower.roofline import decode_read_bytes, machine_ceilings
from llmlower.roofline.study import ABOVE_ROOF_NOTE, artifact_passes
from llmlower.runtime import Engine, Executor, StepBatch, sequential_block_tables
from llmlower.runtime.artifact import read_manifest
from llmlower.spec import ModelSpec

PEERS = Path(__file__).parent / "peers"
# The "q4g32-sym int4 head" row reads what onnxruntime-genai's int4 model reads per token (symmetric int4, int4 LM
# head): the same bytes, at its perplexity cost; "q4g32-sym awq" is symmetric int4 with activation-aware scales;
# "q4mix-a8 gptq f16 scales" is the batch-1 recipe within 5% of fp32's perplexity on a held-out text, "f16 kv" the
# same with its KV cache in float16 (half the KV bytes; held-out perplexity 29.75 against 29.84).
ARTIFACTS = {  # row -> (directory under --artifacts, backend, build_pipeline options and kv_cache_dtype)
    "onnx fp32": ("none", "onnx", {}),
    "onnx q8": ("q8", "onnx", {"quant": "q8"}),
    "onnx q4g32": ("q4g32", "onnx", {"quant": "q4g32"}),
    "onnx q4mix": ("q4mix", "onnx", {"quant": "q4mix"}),
    "onnx q4mix-a8": ("q4mix-a8", "onnx", {"quant": "q4mix-a8"}),
    "onnx q4g32-sym int4 head": ("q4g32-sym-head4", "onnx", {"quant": "q4g32-sym", "lm_head_bits": 4}),
    "onnx q4g32-sym awq": ("q4g32-sym-awq", "onnx", {"quant": "q4g32-sym", "awq": True}),
    "tvm fp32": ("tvm-none", "tvm", {}),
    "tvm q4g32": ("tvm-q4g32", "tvm", {"quant": "q4g32"}),
    "tvm q4mix": ("tvm-q4mix", "tvm", {"quant": "q4mix"}),
    "tvm q4mix-a8": ("tvm-q4mix-a8", "tvm", {"quant": "q4mix-a8"}),
    "tvm q4mix-a8 gptq f16 scales": (
        "tvm-q4mix-a8-gptq-f16",
        "tvm",
        {"quant": "q4mix-a8", "gptq": True, "scale_dtype": "float16"},
    ),
    "tvm q4mix-a8 gptq f16 scales f16 kv": (
        "tvm-q4mix-a8-gptq-f16-kv16",
        "tvm",
        {"quant": "q4mix-a8", "gptq": True, "scale_dtype": "float16", "kv_cache_dtype": "float16"},
    ),
    "tvm q4g32-sym int4 head": ("tvm-q4g32-sym-head4", "tvm", {"quant": "q4g32-sym", "lm_head_bits": 4}),
    "tvm q4g32-sym int4 head f16 scales": (
        "tvm-q4g32-sym-head4-f16",
        "tvm",
        {"quant": "q4g32-sym", "lm_head_bits": 4, "scale_dtype": "float16"},
    ),
}


def recipe_row(recipe: Recipe) -> tuple[str, str, dict[str, object]]:
    """A named recipe's artifact as an ARTIFACTS row: its directory, backend and settings."""
    cache = {} if recipe.kv_cache_dtype == "auto" else {"kv_cache_dtype": recipe.kv_cache_dtype}
    return f"recipe-{recipe.name}", recipe.backend, {**recipe.pipeline_options, **cache}


ARTIFACTS |= {f"recipe {r.name}": recipe_row(r) for r in RECIPES.values() if r.name != "exact"}  # exact: onnx fp32
PROMPT_TOKENS = (13, 512)
GENAI = "onnxruntime-genai int4"
# ONNX ops that read one row of a constant table per token (the embedding, GroupQueryAttention's cos/sin caches)
GATHERING_OPS = {"Gather", "GatherBlockQuantized", "GroupQueryAttention"}
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
    """Per repeat, each prompt's prefill timed (TTFT), and greedy decode speed after the shortest prompt and after
    the longest (its context's KV reads): medians."""
    ttft = {n: [] for n in prompts}
    speeds = {n: [] for n in (min(prompts), max(prompts))}
    for _ in range(repeats):
        for n, ids in prompts.items():
            started = time.perf_counter()
            logits = prefill(ids)
            ttft[n].append(time.perf_counter() - started)
            if n in speeds:
                speeds[n].append(decode_speed(decode, int(logits.argmax()), len(ids), new_tokens))
    return {
        "decode_tokens_per_s": statistics.median(speeds[min(prompts)]),
        "decode_long_tokens_per_s": statistics.median(speeds[max(prompts)]),
        "decode_long_context": max(prompts),
        **{f"ttft_{n}_s": statistics.median(times) for n, times in ttft.items()},
    }


def decode_speed(decode: Decode, token: int, position: int, new_tokens: int) -> float:
    """Tokens/s of new_tokens - 1 greedy steps from `token` at `position`."""
    started = time.perf_counter()
    for step in range(new_tokens - 1):
        token = int(decode(token, position + step).argmax())
    return (new_tokens - 1) / (time.perf_counter() - started)


def artifact(
    model: str, backend: str, options: dict, directory: Path, threads: int, context: int, rebuild: bool
) -> tuple[Prefill, Decode]:
    """A `backend` artifact of MODEL with build_pipeline `options` (and its KV cache in options' kv_cache_dtype),
    compiled into `directory` unless it is there."""
    options = dict(options)
    kv_cache_dtype = options.pop("kv_cache_dtype", "auto")
    built_for = {"cpu": options.pop("cpu")} if "cpu" in options else None
    ensure_artifact(
        model, backend, options, directory, rebuild, kv_cache_dtype=kv_cache_dtype, compile_options=built_for
    )
    return llmlower_executor(Engine.load(directory, max_num_seqs=1, max_context=context, threads=threads).executor)


def peer(
    name: str,
    model: Path,
    prompts: dict[int, list[int]],
    new_tokens: int,
    repeats: int,
    threads: int,
    venv: str = "",
    environment: dict[str, str] | None = None,
) -> dict:
    """Run benchmarks/peers/NAME.py in its own virtual environment (.venv-NAME, or .venv-VENV), in `environment`
    (default: this process's); its JSON line is the row."""
    python = PEERS / f".venv-{venv or name}" / "bin" / "python"
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump({str(n): ids for n, ids in prompts.items()}, f)
        f.flush()
        command = [str(python), str(PEERS / f"{name}.py"), "--model", str(model), "--prompts", f.name]
        command += ["--new-tokens", str(new_tokens), "--repeats", str(repeats), "--threads", str(threads)]
        done = subprocess.run(command, capture_output=True, text=True, env=environment)
    if done.returncode != 0:
        raise SystemExit(f"{name}.py failed ({done.returncode}):\n{done.stderr}")
    rows = [line for line in done.stdout.splitlines() if line.startswith("{")]  # a peer may log to stdout too
    return json.loads(rows[-1])


def decode_context(new_tokens: int) -> int:
    """The mean context of the decode loop after the short prompt: its KV reads grow linearly with the context."""
    return PROMPT_TOKENS[0] + new_tokens // 2


def artifact_read_bytes(captured: Program, directory: Path, context: int) -> int:
    """Bytes per decoded token of the artifact in `directory`: its manifest's pipeline replayed on the captured
    model and costed by the roofline cost model."""
    program = run_pipeline(copy.deepcopy(captured), artifact_passes(read_manifest(directory)))
    return decode_read_bytes(program, context)


def _tensor_bytes(tensor: onnx.TensorProto) -> int:
    """Bytes of an ONNX initializer from its shape and element type (its data may be in an external file)."""
    itemsize = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
    return int(np.prod(tensor.dims, dtype=np.int64)) * itemsize


def onnx_weight_reads(model: onnx.ModelProto) -> int:
    """Bytes of an ONNX model's initializers one decoded token reads: each in full, except a table only
    gathered from, of which it reads one row."""
    consumers = defaultdict(set)
    for node in model.graph.node:
        for name in node.input:
            consumers[name].add(node.op_type)
    total = 0
    for tensor in model.graph.initializer:
        size = _tensor_bytes(tensor)
        gathered = tensor.dims and consumers[tensor.name] <= GATHERING_OPS
        total += size // tensor.dims[0] if gathered else size
    return total


def ortgenai_read_bytes(model_dir: Path, spec: ModelSpec, context: int) -> int:
    """Bytes per decoded token of an ONNX Runtime GenAI model: its weights plus the KV cache at `context`
    positions in the dtype of its past_key_values inputs."""
    model = onnx.load(model_dir / "model.onnx", load_external_data=False)
    past = next(i for i in model.graph.input if i.name.startswith("past_key_values"))
    kv_dtype = onnx.helper.tensor_dtype_to_np_dtype(past.type.tensor_type.elem_type).name
    return onnx_weight_reads(model) + spec.kv_cache_bytes(context, dtype=kv_dtype)


def llamacpp_read_bytes(path: Path, spec: ModelSpec, context: int) -> int:
    """Bytes per decoded token of a GGUF on llama.cpp: every tensor (the token embedding table only one row
    when the model has a separate output tensor; tied, it is the LM head) plus an f16 KV cache (llama-cpp-python's
    default) at `context` positions."""
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    total = sum(int(t.n_bytes) for t in tensors.values())
    table = tensors.get("token_embd.weight")
    if table is not None and "output.weight" in tensors:
        total -= int(table.n_bytes) - int(table.n_bytes) // int(table.shape[-1])
    return total + spec.kv_cache_bytes(context, dtype="float16")


PEER_READS = {"ortgenai": ortgenai_read_bytes, "llamacpp": llamacpp_read_bytes}


def peer_models() -> dict[str, tuple[str, Path]]:
    """Peer rows whose setup.sh has been run: row name -> (runner, model path)."""
    cache = cache_dir()
    candidates = {
        GENAI: ("ortgenai", cache / "peers" / "ortgenai-int4"),
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
    parser.add_argument("--rounds", type=int, default=1, help="measure every row this many times, taking turns")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--artifacts", type=Path, help="where the artifacts are compiled and reused")
    parser.add_argument("--rebuild", action="store_true", help="compile the artifacts even if present")
    parser.add_argument("--only", help="comma-separated row names to run (default: all)")
    parser.add_argument(
        "--tvm-cpus",
        default="",
        help="also build each tvm row for these LLVM CPUs, comma-separated (x86-64-v3: AVX2 only; rocketlake or "
        "icelake-server: AVX-512 VNNI without AMX); their rows are named 'ROW --cpu NAME'",
    )
    parser.add_argument("--json", help="also write the table to this file")
    parser.add_argument(
        "--remeasure", action="store_true", help="measure the memory bandwidth again, not from the cache"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    artifacts = args.artifacts or cache_dir() / "bench" / Path(args.model).name
    ceilings = machine_ceilings("cpu", remeasure=args.remeasure)

    loaded = load(resolve_model(args.model))
    captured = capture(loaded)
    program = run_pipeline(copy.deepcopy(captured), DEFAULT_PIPELINE)
    filler = tokenizer_of(loaded).encode(FILLER * 64, add_special_tokens=False)
    prompts = {n: filler[:n] for n in PROMPT_TOKENS}
    context = max(PROMPT_TOKENS) + args.new_tokens + 1
    read_context = decode_context(args.new_tokens)

    engines: dict[str, Callable[[], tuple[Prefill, Decode]]] = {
        "transformers eager fp32": lambda: transformers_eager(loaded.module),
        "llmlower torch fp32": lambda: llmlower_executor(TorchExecutor(program, max_context=context)),
    }
    # row -> bytes a decoded token reads; transformers eager reads the same fp32 weights and KV cache as ours
    reads: dict[str, Callable[[], int]] = dict.fromkeys(engines, lambda: decode_read_bytes(program, read_context))
    builds = dict(ARTIFACTS)
    for cpu in filter(None, args.tvm_cpus.split(",")):
        builds |= {
            f"{row} --cpu {cpu}": (f"{name}-{cpu}", backend, {**options, "cpu": cpu})
            for row, (name, backend, options) in ARTIFACTS.items()
            if backend == "tvm"
        }
    for row, (name, backend, options) in builds.items():
        engines[row] = lambda b=backend, o=options, d=artifacts / name: artifact(
            args.model, b, o, d, args.threads, context, args.rebuild
        )
        reads[row] = lambda d=artifacts / name: artifact_read_bytes(captured, d, read_context)
    peers = peer_models() if args.model == "example" else {}
    for row, (runner, path) in peers.items():
        reads[row] = lambda r=runner, p=path: PEER_READS[r](p, loaded.spec, read_context)
    wanted = set(args.only.split(",")) if args.only else set(engines) | set(peers)
    repeat = (args.new_tokens, args.repeats)
    runs: dict[str, Callable[[], dict]] = {}  # row -> one measurement; our engines load once, peers start each time
    for name, make in engines.items():
        if name in wanted:
            load_once = functools.cache(make)
            runs[name] = lambda m=load_once: measure(*m(), prompts, *repeat)
    for name, (runner, path) in peers.items():
        if name in wanted:
            runs[name] = lambda r=runner, p=path: peer(r, p, prompts, *repeat, args.threads)
    rounds = take_turns(runs, args.rounds)
    rows = {name: median_row(results) for name, results in rounds.items()}
    for name, row in rows.items():
        row.update(bandwidth_roof(row["decode_tokens_per_s"], reads[name](), ceilings.bandwidth))
        row["vs_genai"] = ratio_to(rounds, name, GENAI) if GENAI in rows else None
    print_table(rows, args, ceilings.bandwidth, read_context)
    if args.json:
        machine = {"description": ceilings.description, "bandwidth_bytes_per_s": ceilings.bandwidth}
        with open(args.json, "w") as f:
            json.dump({"machine": machine, "decode_context": read_context, "rows": rows, "rounds": rounds}, f, indent=2)


def take_turns(runs: dict[str, Callable[[], dict]], rounds: int) -> dict[str, list[dict]]:
    """Each row's measurements over `rounds` rounds, the rows in turn, every other round in reverse order."""
    results: dict[str, list[dict]] = {name: [] for name in runs}
    for number in range(rounds):
        order = list(runs) if number % 2 == 0 else list(reversed(runs))
        for name in order:
            print(f"[speed] round {number + 1}/{rounds}: {name}", file=sys.stderr)
            results[name].append(runs[name]())
    return results


def median_row(results: list[dict]) -> dict:
    """One row from its rounds: the median of each figure (a peer's engine and version as they are)."""
    return {
        key: statistics.median(r[key] for r in results) if isinstance(value, float) else value
        for key, value in results[0].items()
    }


def ratio_to(rounds: dict[str, list[dict]], name: str, baseline: str) -> float:
    """The median over the rounds of row `name`'s decode speed over `baseline`'s in the same round."""
    pairs = zip(rounds[name], rounds[baseline], strict=True)
    return statistics.median(a["decode_tokens_per_s"] / b["decode_tokens_per_s"] for a, b in pairs)


def bandwidth_roof(tokens_per_s: float, bytes_per_token: int, bandwidth: float) -> dict[str, float]:
    """A row's bandwidth roof: the tokens/s reading `bytes_per_token` per token at `bandwidth` allows, and the
    row's measured tokens/s as a % of it."""
    roof = bandwidth / bytes_per_token
    return {"bytes_per_token": bytes_per_token, "roof_tokens_per_s": roof, "roof_pct": 100 * tokens_per_s / roof}


def print_table(rows: dict[str, dict], args: argparse.Namespace, bandwidth: float, read_context: int) -> None:
    """Rows with decode tok/s, its ratio to the first row and to GenAI's, bytes per token, the bandwidth roof
    and the % of it reached, and TTFT in ms; then a warning for rows above their roof."""
    baseline = next(iter(rows.values()))["decode_tokens_per_s"]
    print(f"{args.threads} threads, batch 1, {args.new_tokens} new tokens, median of {args.repeats}")
    print(
        f"roof = {bandwidth / 1e9:.1f} GB/s (measured) / bytes a token reads (weights + KV at context {read_context})"
    )
    print(
        f"{'engine':<26} {'decode tok/s':>12} {'vs first':>9} {'vs GenAI':>9} {'MB/token':>9} {'roof tok/s':>10} "
        f"{'% of roof':>9} {'TTFT 13 ms':>11} {'TTFT 512 ms':>12}"
    )
    for name, row in rows.items():
        vs_genai = "–" if row["vs_genai"] is None else f"{row['vs_genai']:.2f}x"
        print(
            f"{name:<26} {row['decode_tokens_per_s']:>12.1f} {row['decode_tokens_per_s'] / baseline:>8.2f}x "
            f"{vs_genai:>9} {row['bytes_per_token'] / 1e6:>9.1f} {row['roof_tokens_per_s']:>10.1f} "
            f"{row['roof_pct']:>8.0f}% {row['ttft_13_s'] * 1000:>11.0f} {row['ttft_512_s'] * 1000:>12.0f}"
        )
    above = [name for name, row in rows.items() if row["roof_pct"] > 100]
    if above:
        print(f"⚠ {'; '.join(above)}: {ABOVE_ROOF_NOTE}")


if __name__ == "__main__":
    main()
