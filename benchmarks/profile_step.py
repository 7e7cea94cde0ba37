"""Where the time of a continuous-batching decode step goes: the engine's phases (scheduler and block manager,
executor, sampler, detokenizer) and the model step's time per operator type (ONNX Runtime's profiler) or per
compiled function (TVM: the Relax VM's instrument hook, timing every call it makes, kernels and VM builtins).

N sequences (SmolLM2 chat prompts padded to --context tokens) decode together on an artifact; after a warm-up,
--steps decode steps are timed with the engine's methods wrapped in timers, and the ONNX session is profiled; on
TVM, --steps more steps are then run with the VM instrumented (its per-call hook adds a little to each call; an
artifact compiled with --vm-exec bytecode: the default, compiled VM code has no hook).

    .venv/bin/python benchmarks/profile_step.py ARTIFACT [--streams 16] [--context 512] [--steps 20] [--threads 2]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from llmlower.runtime import Engine, EngineConfig, SamplingParams
from llmlower.runtime.executors.onnx import OnnxSlotExecutor
from llmlower.runtime.executors.tvm import TvmExecutor

FILLER = "The runtime keeps a cache of keys and values so that each new token reads the past once. "


def timed(totals: dict[str, float], name: str, function: Callable) -> Callable:
    """`function` with its wall time added to totals[name] on every call."""

    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            totals[name] += time.perf_counter() - started

    return wrapper


def operator_times(trace: Path, last_runs: int) -> dict[str, float]:
    """Milliseconds per operator type in the last `last_runs` session runs of an ONNX Runtime profile."""
    events = json.loads(trace.read_text())
    runs = [e for e in events if e.get("cat") == "Session" and e["name"] == "model_run"][-last_runs:]
    start, end = runs[0]["ts"], runs[-1]["ts"] + runs[-1]["dur"]
    totals: dict[str, float] = collections.defaultdict(float)
    for event in events:
        if event.get("cat") == "Node" and event["name"].endswith("_kernel_time") and start <= event["ts"] <= end:
            totals[event["args"]["op_name"]] += event["dur"] / 1000 / last_runs
    return dict(totals)


class VmCallTimes:
    """A Relax VM instrument: seconds and calls per function it calls (kernels by their compiled names)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.calls: collections.Counter[str] = collections.Counter()
        self.started: dict[str, float] = {}

    def __call__(self, func: object, name: str, before_run: bool, ret_value: object, *args: object) -> int:
        now = time.perf_counter()
        if before_run:
            self.started[name] = now
        else:
            self.seconds[name] += now - self.started.pop(name)
            self.calls[name] += 1
        return 0  # carry on with the call


def print_rows(title: str, rows: dict[str, float], steps: int, calls: dict[str, int] | None = None) -> None:
    """The eight largest rows (milliseconds per step) with their share, and calls per step where counted."""
    total = sum(rows.values())
    print(f"\n{title} ({total:.1f} ms per step)")
    print("| name | ms per step | share |" + (" calls per step |" if calls else ""))
    print("|---|---:|---:|" + ("---:|" if calls else ""))
    for name, ms in sorted(rows.items(), key=lambda item: -item[1])[:8]:
        print(f"| {name} | {ms:.2f} | {ms / total:.0%} |" + (f" {calls[name] // steps} |" if calls else ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--context", type=int, default=512, help="prompt tokens of each sequence")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    args = parser.parse_args()
    decode_room = 1024  # tokens a sequence may decode while the others are still being prefilled
    config = EngineConfig(max_num_seqs=args.streams, max_context=args.context + decode_room)
    engine = Engine.load(args.artifact, config, threads=args.threads)
    executor = engine.executor
    manifest = json.loads((args.artifact / "manifest.json").read_text())
    if isinstance(executor, OnnxSlotExecutor):  # the same model in a profiled session
        model = str(args.artifact / manifest["entry_points"]["step"]["file"])
        context, blocks = executor.max_context, executor.num_blocks
        executor = OnnxSlotExecutor(model, context, blocks, threads=args.threads, profile=True)
        engine = Engine(executor, engine.tokenizer, engine.spec, config=config)
    filler = engine.tokenizer.encode(FILLER * (args.context // 8), add_special_tokens=False)
    prompts = [filler[i : i + args.context] for i in range(args.streams)]
    params = SamplingParams(temperature=0, max_tokens=decode_room - 1, ignore_eos=True)
    for prompt in prompts:
        engine.add_request(prompt, params)
    while engine.stats().running < args.streams or any(s.num_uncomputed > 1 for s in engine.scheduler.running):
        engine.step()  # prefill every prompt (the first ones decode meanwhile)
    engine.step()  # a warm-up decode
    totals: dict[str, float] = collections.defaultdict(float)
    engine.scheduler.schedule = timed(totals, "scheduler + block manager", engine.scheduler.schedule)
    engine.blocks.commit = timed(totals, "scheduler + block manager", engine.blocks.commit)
    engine.executor.step = timed(totals, "executor (model step)", engine.executor.step)
    engine.sampler.sample = timed(totals, "sampler", engine.sampler.sample)
    started = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    wall = time.perf_counter() - started
    totals["detokenizer + engine bookkeeping"] = wall - sum(totals.values())
    context = int(np.mean([len(s.token_ids) for s in engine.scheduler.running]))
    print(f"{args.streams} sequences decoding at context ~{context}, {args.steps} steps, load {os.getloadavg()}")
    print(f"step: {wall / args.steps * 1000:.1f} ms, {args.streams * args.steps / wall:.1f} tokens/s")
    print("| phase | ms per step | share |\n|---|---:|---:|")
    for name, seconds in sorted(totals.items(), key=lambda item: -item[1]):
        print(f"| {name} | {seconds / args.steps * 1000:.2f} | {seconds / wall:.0%} |")
    if isinstance(executor, OnnxSlotExecutor):
        ops = operator_times(Path(executor.session.end_profiling()), args.steps)
        print_rows("ONNX Runtime operators in a decode step (kernel time)", ops, args.steps)
    if isinstance(executor, TvmExecutor) and manifest.get("tvm", {}).get("vm_exec") == "compiled":
        print("\nper-function times: the VM's calls are compiled code here; compile with --vm-exec bytecode for them")
    elif isinstance(executor, TvmExecutor):
        calls = VmCallTimes()
        executor.vm.set_instrument(calls)
        for _ in range(args.steps):
            engine.step()
        functions = {name: seconds * 1000 / args.steps for name, seconds in calls.seconds.items()}
        print_rows("TVM functions in a decode step (instrumented)", functions, args.steps, calls.calls)


if __name__ == "__main__":
    main()
