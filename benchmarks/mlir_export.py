"""The mlir backend on a real model: SmolLM2 (or --model) captured once, after the default pipeline, exported in
each dialect (time, module and weights size, the dialects its ops use), then the linalg artifact run by the
runtime's linalg executor: its load (JIT) time, per-token times, and its greedy tokens for one prompt against the
torch reference's (same tokens expected; the largest logit difference on the prompt is printed too).

    .venv/bin/python benchmarks/mlir_export.py [--model example] [--dialects torch,linalg,stablehlo,tosa]
        [--new-tokens 8] [--out DIR] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import numpy as np

from llmlower.api import compile_program
from llmlower.backends.mlir.artifact import build
from llmlower.backends.torch.program_executor import TorchExecutor
from llmlower.frontend.example import cache_dir
from llmlower.runtime import Engine, SamplingParams, StepBatch
from llmlower.runtime.executor import sequential_block_tables
from llmlower.runtime.tokenizer import Tokenizer

PROMPT = "What is the capital of France?"


def export_all(model: str, dialects: list[str], out: Path) -> tuple[object, object, list[dict]]:
    """Capture and run the default pipeline once, then write an artifact per dialect; returns the loaded model,
    the program and one row per dialect."""
    started = time.perf_counter()
    loaded, program = compile_program(model)
    print(f"capture + default pipeline: {time.perf_counter() - started:.1f} s", flush=True)
    rows = []
    for dialect in dialects:
        started = time.perf_counter()
        directory = build(program, out / dialect, dialect=dialect, write_extra=loaded.tokenizer.write)
        seconds = time.perf_counter() - started
        manifest = json.loads((directory / "manifest.json").read_text())
        module = (directory / "model.mlir").stat().st_size
        weights = (directory / "weights.safetensors").stat().st_size
        row = {
            "dialect": dialect,
            "export_s": round(seconds, 1),
            "module_mib": round(module / 2**20, 2),
            "weights_mib": round(weights / 2**20, 1),
            "op_dialects": manifest["mlir"]["op_dialects"],
            "static_dims": manifest["mlir"]["static_dims"],
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    return loaded, program, rows


def run_linalg(directory: Path, program, prompt_ids: list[int], new_tokens: int) -> dict:
    """Load the linalg artifact (the JIT) and decode greedily through its executor beside the torch reference's,
    step by step (the tokens of each, the largest logit difference, the step times), then through the engine."""
    started = time.perf_counter()
    engine = Engine.load(directory, max_num_seqs=1, max_context=len(prompt_ids) + new_tokens)
    load_s = time.perf_counter() - started
    ours = engine.executor
    reference = TorchExecutor(program, ours.max_context, ours.num_blocks, ours.block_size)
    table = sequential_block_tables(ours, [ours.max_context])
    tokens, past, worst, times = prompt_ids, 0, 0.0, []
    generated = {"linalg": [], "torch": []}
    for _ in range(new_tokens):
        batch = StepBatch([tokens], [past], table)
        started = time.perf_counter()
        got = ours.step(batch)
        times.append(time.perf_counter() - started)
        expected = reference.step(batch)
        worst = max(worst, float(np.abs(got - expected).max()))
        generated["linalg"].append(int(got[0].argmax()))
        generated["torch"].append(int(expected[0].argmax()))
        past += len(tokens)
        tokens = [generated["torch"][-1]]  # both continue from the reference's token
        print(f"step {len(times)}: {times[-1]:.2f} s", flush=True)
    started = time.perf_counter()
    (result,) = engine.generate([prompt_ids], SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True))
    generated["engine"] = result.token_ids
    return {
        "load_s": round(load_s, 1),
        "engine_generate_s": round(time.perf_counter() - started, 1),
        "prefill_s": round(times[0], 2),
        "decode_s_per_token": round(float(np.median(times[1:])), 2) if len(times) > 1 else None,
        "max_logit_difference": worst,
        "tokens": generated,
        "same": generated["linalg"] == generated["torch"] == generated["engine"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="example")
    parser.add_argument("--dialects", default="torch,linalg,stablehlo,tosa")
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--out", type=Path, default=cache_dir() / "bench" / "mlir")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    dialects = args.dialects.split(",")
    if args.out.exists():
        shutil.rmtree(args.out)  # artifacts are never replaced in place
    loaded, program, rows = export_all(args.model, dialects, args.out)
    result = {"exports": rows}
    if "linalg" in dialects:
        tokenizer = Tokenizer.from_dir(args.out / "linalg")
        prompt_ids = tokenizer.encode(
            tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}]), add_special_tokens=False
        )
        run = run_linalg(args.out / "linalg", program, prompt_ids, args.new_tokens)
        run["text"] = tokenizer.decode(run["tokens"]["linalg"])
        result["linalg_run"] = run
        print(json.dumps(run), flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
