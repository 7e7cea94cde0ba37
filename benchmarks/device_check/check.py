"""The GPU check's phases, each run by run.sh as its own bounded process on the lent GPU machine (and their CPU
parts here): `env` (what the machine has), `agree` (greedy tokens of the tiny Llama: each CUDA artifact against
its CPU twin and against transformers), `speed NAME` (decode tokens/s of a bundle artifact with random weights
at batch 1, 16 and 64, with each step's share of the HBM roof), `kernels NAME` (where a decode step's time goes:
each kernel's GPU time, and the step's wall time beside the sum) and `summary` (the table of all of them).

Each phase prints as it goes and writes its result to OUT/phases/PHASE.json; summary reads them (a phase that
timed out or crashed shows as missing) and writes OUT/device-check.json.

    python3 benchmarks/device_check/check.py --bundle build/device-check/bundle --out DIR \
        env|agree|speed NAME|kernels NAME|summary
"""

from __future__ import annotations

import argparse
import importlib
import json
import platform
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

PROMPTS = ("What is the capital of France?", "Write a haiku about compilers.", "List three prime numbers.")
AGREE_TOKENS, MUST_AGREE = 32, 8  # greedy tokens compared; a CUDA artifact must match its CPU twin's first 8
BATCH_SECONDS = 12.0  # a speed run stops timing a batch size after this long, whatever its steps
WARMUP_STEPS = 2
KERNEL_BATCHES, KERNEL_STEPS, TOP_KERNELS = (1, 16), 5, 8  # the kernels phase: steps profiled per batch size
CUDA_EP = "CUDAExecutionProvider"


def say(message: str) -> None:
    print(message, flush=True)


def versions() -> dict[str, str | None]:
    """Versions of the packages the runtime and the check use (None: not installed)."""
    found: dict[str, str | None] = {}
    packages = ("numpy", "tokenizers", "safetensors", "jinja2", "ml_dtypes", "onnx", "onnxruntime", "torch")
    for name in (*packages, "transformers"):
        try:
            found[name] = importlib.import_module(name).__version__
        except ImportError:
            found[name] = None
    return found


def onnx_cuda() -> tuple[bool, list[str]]:
    """Whether this onnxruntime offers the CUDA EP, and the providers it offers."""
    import onnxruntime

    providers = onnxruntime.get_available_providers()
    return CUDA_EP in providers, providers


def no_cuda_ep() -> str | None:
    """Why ONNX CUDA artifacts are skipped here (onnxruntime offers no CUDA EP), or None."""
    has_cuda_ep, providers = onnx_cuda()
    return None if has_cuda_ep else f"onnxruntime offers {', '.join(providers)}: no CUDA EP"


def phase_env(bundle: Path, plan: dict[str, Any]) -> dict[str, Any]:
    """The machine: GPU, Python, packages, onnxruntime's providers, TVM's runtime and its CUDA device."""
    result: dict[str, Any] = {"python": platform.python_version(), "versions": versions()}
    query = ["nvidia-smi", "--query-gpu=name,memory.total,driver_version,compute_cap", "--format=csv,noheader"]
    try:
        smi = subprocess.run(query, capture_output=True, text=True, timeout=30)
        result["gpu"] = smi.stdout.strip() or smi.stderr.strip()
    except OSError as exc:
        result["gpu"] = f"nvidia-smi: {exc}"
    say(f"GPU: {result['gpu']}; Python {result['python']}")
    say("packages: " + ", ".join(f"{k} {v}" for k, v in result["versions"].items()))
    has_cuda_ep, providers = onnx_cuda()
    result["onnxruntime_providers"] = providers
    say(f"onnxruntime providers: {', '.join(providers)} (CUDA EP {'present' if has_cuda_ep else 'ABSENT'})")
    import tvm

    from llmlower.runtime.executors.tvm import load_cuda_runtime

    reason = load_cuda_runtime()
    device = tvm.cuda(0)
    result["tvm"] = {
        "file": tvm.__file__,
        "runtime_only": bool(tvm.base._RUNTIME_ONLY),
        "cuda_runtime": reason or "loaded",
        "cuda_device": bool(device.exist),
        "compute_version": device.compute_version if device.exist else None,
    }
    say(f"TVM runtime: {result['tvm']}")
    return result


def greedy_tokens(engine: Any, prompts: tuple[str, ...]) -> list[list[int]]:
    """AGREE_TOKENS greedy tokens of each prompt (chat template, EOS ignored)."""
    from llmlower.runtime import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=AGREE_TOKENS, ignore_eos=True)
    return [r.token_ids for r in engine.generate(list(prompts), params)]


def reference_tokens(checkpoint: Path, prompt_ids: list[list[int]]) -> list[list[int]]:
    """transformers' own greedy tokens (float32, CPU) from the same prompt token ids."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    outputs = []
    for ids in prompt_ids:
        with torch.no_grad():
            generated = model.generate(
                torch.tensor([ids]),
                do_sample=False,
                max_new_tokens=AGREE_TOKENS,
                min_new_tokens=AGREE_TOKENS,
                pad_token_id=0,
            )
        outputs.append(generated[0, len(ids) :].tolist())
    return outputs


def agreeing(a: list[int], b: list[int]) -> int:
    """How many leading tokens two greedy outputs share."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def phase_agree(bundle: Path, plan: dict[str, Any]) -> dict[str, Any]:
    """Greedy agreement of each (CUDA, CPU) pair of tiny-Llama artifacts, and of each with transformers."""
    from llmlower.runtime import Engine

    models = bundle / "models"
    skip_onnx = no_cuda_ep()
    reference: list[list[int]] | None = None
    result: dict[str, Any] = {"pairs": {}}
    for cuda_name, cpu_name in plan["agreement"]["pairs"]:
        key = f"{cuda_name} vs {cpu_name}"
        if "onnx" in cuda_name and skip_onnx:
            result["pairs"][key] = {"skipped": skip_onnx}
            say(f"{key}: skipped ({skip_onnx})")
            continue
        try:
            cuda = Engine.load(models / cuda_name, max_num_seqs=len(PROMPTS), max_context=128)
            cpu = Engine.load(models / cpu_name, max_num_seqs=len(PROMPTS), max_context=128)
            on_gpu, on_cpu = greedy_tokens(cuda, PROMPTS), greedy_tokens(cpu, PROMPTS)
            if reference is None:
                prompt_ids = [cpu.prompt_token_ids(p) for p in PROMPTS]
                reference = reference_tokens(bundle / plan["agreement"]["checkpoint"], prompt_ids)
        except Exception as exc:  # report and go on with the next pair
            result["pairs"][key] = {"error": f"{type(exc).__name__}: {exc}"}
            say(f"{key}: FAILED {type(exc).__name__}: {exc}")
            continue
        rows = [
            {
                "prompt": prompt,
                "cuda_vs_cpu": agreeing(g, c),
                "cuda_vs_transformers": agreeing(g, r),
                "cpu_vs_transformers": agreeing(c, r),
            }
            for prompt, g, c, r in zip(PROMPTS, on_gpu, on_cpu, reference, strict=True)
        ]
        passed = all(row["cuda_vs_cpu"] >= MUST_AGREE for row in rows)
        result["pairs"][key] = {"rows": rows, "passed": passed}
        for row in rows:
            say(
                f"{key} {row['prompt']!r}: of {AGREE_TOKENS} greedy tokens, cuda=cpu {row['cuda_vs_cpu']}, "
                f"cuda=transformers {row['cuda_vs_transformers']}, cpu=transformers {row['cpu_vs_transformers']}"
            )
        say(f"{key}: {'PASS' if passed else 'FAIL'} (the first {MUST_AGREE} must agree)")
    return result


def decode_batch(executor: Any, batch: int, prompt: int, positions: int, vocab: int) -> tuple[float, Callable[[], Any]]:
    """Prefill `batch` random prompts of `prompt` tokens in one step (block tables for `positions` each): the
    prefill's seconds, and a function that runs their next decode step and returns its logits."""
    from llmlower.runtime import StepBatch, sequential_block_tables

    tables = sequential_block_tables(executor, [positions] * batch)
    ids = np.random.default_rng(batch).integers(0, vocab, (batch, prompt)).tolist()
    started = time.perf_counter()
    executor.step(StepBatch(ids, [0] * batch, tables))
    prefill_s = time.perf_counter() - started
    past = [prompt]

    def step() -> np.ndarray:
        logits = executor.step(StepBatch([[5]] * batch, [past[0]] * batch, tables))
        past[0] += 1
        return logits

    return prefill_s, step


def time_decode(executor: Any, batch: int, prompt: int, steps: int, vocab: int) -> dict[str, float]:
    """Prefill `batch` sequences of `prompt` tokens in one step, then time up to `steps` decode steps (stopping
    after BATCH_SECONDS): seconds per step and tokens/s."""
    steps = min(steps, executor.max_context - prompt - WARMUP_STEPS)  # a model of fewer positions: fewer steps
    prefill_s, step = decode_batch(executor, batch, prompt, prompt + WARMUP_STEPS + steps, vocab)
    for _ in range(WARMUP_STEPS):
        logits = step()
    started, done = time.perf_counter(), 0
    while done < steps and time.perf_counter() - started < BATCH_SECONDS:
        logits = step()
        done += 1
    elapsed = time.perf_counter() - started
    return {
        "prefill_s": prefill_s,
        "steps": done,
        "step_s": elapsed / done,
        "tokens_per_s": batch * done / elapsed,
        "finite": bool(np.isfinite(logits).all()),
    }


def build_skipped(name: str, record: dict[str, Any]) -> str | None:
    """Why a build cannot run here (an ONNX one without the CUDA EP), said aloud; None if it can."""
    skip = no_cuda_ep() if record["recipe"]["backend"] == "onnx" else None
    if skip:
        say(f"{name}: skipped ({skip})")
    return skip


def phase_speed(bundle: Path, plan: dict[str, Any], name: str) -> dict[str, Any]:
    """Decode speed of one artifact with random weights at each batch size, with its share of the HBM roof."""
    from llmlower.runtime import Engine

    record = plan["builds"][name]
    if skip := build_skipped(name, record):
        return {"skipped": skip}
    batches, prompt, steps = plan["batches"], plan["prompt"], plan["steps"]
    started = time.perf_counter()
    engine = Engine.load(
        bundle / "models" / name,
        weights="random",
        max_num_seqs=max(batches),
        max_context=prompt + WARMUP_STEPS + steps,
    )
    load_s = time.perf_counter() - started
    say(f"{name}: loaded with random weights in {load_s:.1f}s")
    result: dict[str, Any] = {"load_s": load_s, "batches": {}}
    for batch in batches:
        timing = time_decode(engine.executor, batch, prompt, steps, engine.spec.vocab_size)
        cost = record["costs"][str(batch)]
        timing["bytes"] = cost["bytes"]
        timing["hbm_roof_pct"] = 100 * cost["bytes"] / timing["step_s"] / plan["hbm_bytes_per_s"]
        result["batches"][str(batch)] = timing
        say(
            f"{name} batch {batch}: {timing['tokens_per_s']:.0f} tokens/s, {1e3 * timing['step_s']:.2f} ms/step "
            f"({timing['steps']} steps), {cost['bytes'] / 1e6:.0f} MB/step = {timing['hbm_roof_pct']:.1f}% of the "
            f"HBM roof; prefill {batch}x{prompt} in {timing['prefill_s']:.2f}s; finite logits: {timing['finite']}"
        )
    return result


def phase_kernels(bundle: Path, plan: dict[str, Any], name: str) -> dict[str, Any]:
    """Each kernel's GPU time in a decode step (CUPTI, through torch's profiler: torch is on the GPU machine) at
    KERNEL_BATCHES, beside the step's wall time: what the gap between them is spent on is the host's."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from llmlower.runtime import Engine

    if skip := build_skipped(name, plan["builds"][name]):
        return {"skipped": skip}
    prompt = plan["prompt"]
    context = prompt + WARMUP_STEPS + 2 * KERNEL_STEPS
    engine = Engine.load(
        bundle / "models" / name, weights="random", max_num_seqs=max(KERNEL_BATCHES), max_context=context
    )
    if torch.cuda.is_available():
        torch.cuda.init()  # before the profiler starts, so that CUPTI sees the device
    result: dict[str, Any] = {}
    for batch in KERNEL_BATCHES:
        _, step = decode_batch(engine.executor, batch, prompt, context, engine.spec.vocab_size)
        for _ in range(WARMUP_STEPS):
            step()
        # torch warns that its profiler "clears events at the end of each cycle": there is one cycle here
        quiet = warnings.catch_warnings(action="ignore", category=UserWarning)
        with quiet, profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiler:
            started = time.perf_counter()
            for _ in range(KERNEL_STEPS):
                step()
            wall_ms = 1e3 * (time.perf_counter() - started) / KERNEL_STEPS
        events = [e for e in profiler.key_averages() if e.self_device_time_total > 0]
        kernels = sorted(
            (
                {"name": e.key, "ms": e.self_device_time_total / 1e3 / KERNEL_STEPS, "calls": e.count // KERNEL_STEPS}
                for e in events
            ),
            key=lambda k: -k["ms"],
        )
        gpu_ms = sum(k["ms"] for k in kernels)
        result[str(batch)] = {"wall_ms": wall_ms, "gpu_ms": gpu_ms, "kernels": kernels}
        calls = sum(k["calls"] for k in kernels)
        say(f"{name} batch {batch}: {wall_ms:.2f} ms/step; kernels and copies: {gpu_ms:.2f} ms, {calls} a step")
        for k in kernels[:TOP_KERNELS]:
            say(f"  {k['ms']:7.3f} ms  x{k['calls']:<4d} {k['name'][:100]}")
    return result


def phase_summary(out: Path, plan: dict[str, Any]) -> dict[str, Any]:
    """The table of every phase's results (a missing one timed out or crashed: its output above says why)."""
    phases = {p.stem: json.loads(p.read_text()) for p in sorted((out / "phases").glob("*.json"))}
    say("== summary ==")
    for name in ["env", "agree", *(f"speed-{n}" for n in plan["speed"])]:
        if name not in phases:
            say(f"{name}: no result (timed out or crashed: see its output above)")
    for name in plan["speed"]:
        speed = phases.get(f"speed-{name}", {})
        if "error" in speed or "skipped" in speed:
            say(f"{name}: {speed.get('error') or 'skipped: ' + speed['skipped']}")
        for batch, t in speed.get("batches", {}).items():
            say(
                f"{name:28} B={batch:>3} {t['tokens_per_s']:>9.0f} tok/s {1e3 * t['step_s']:>8.2f} ms/step "
                f"{t['hbm_roof_pct']:>6.1f}% of HBM roof"
            )
    for name, kernels in ((p[len("kernels-") :], r) for p, r in phases.items() if p.startswith("kernels-")):
        for batch, k in kernels.items():
            if batch.isdigit():
                say(f"{name:28} B={batch:>3} {k['wall_ms']:>8.2f} ms/step, {k['gpu_ms']:.2f} of them in kernels")
    for key, pair in phases.get("agree", {}).get("pairs", {}).items():
        verdict = "PASS" if pair.get("passed") else pair.get("skipped") or pair.get("error") or "FAIL"
        say(f"agreement {key}: {verdict}")
    return phases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bundle", type=Path, required=True, help="the folder prepare.py built")
    parser.add_argument("--out", type=Path, required=True, help="where each phase writes its JSON")
    parser.add_argument("phase", choices=["env", "agree", "speed", "kernels", "summary"])
    parser.add_argument("name", nargs="?", help="speed, kernels: the bundle artifact to run")
    args = parser.parse_args()
    plan = json.loads((args.bundle / "plan.json").read_text())
    phases: dict[str, Callable[[], Any]] = {
        "env": lambda: phase_env(args.bundle, plan),
        "agree": lambda: phase_agree(args.bundle, plan),
        "speed": lambda: phase_speed(args.bundle, plan, args.name),
        "kernels": lambda: phase_kernels(args.bundle, plan, args.name),
    }
    if args.phase == "summary":
        (args.out / "device-check.json").write_text(json.dumps(phase_summary(args.out, plan), indent=1))
        return
    name = f"{args.phase}-{args.name}" if args.name else args.phase
    say(f"== {name} ==")
    started = time.perf_counter()
    try:
        result = phases[args.phase]()
    except Exception as exc:  # recorded: the other phases still run
        traceback.print_exc()
        result = {"error": f"{type(exc).__name__}: {exc}"}
    result["seconds"] = round(time.perf_counter() - started, 1)
    (args.out / "phases").mkdir(parents=True, exist_ok=True)
    (args.out / "phases" / f"{name}.json").write_text(json.dumps(result, indent=1))
    say(f"== {name}: {result['seconds']}s ==")
    sys.exit(1 if "error" in result else 0)


if __name__ == "__main__":
    main()
