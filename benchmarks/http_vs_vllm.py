"""Through HTTP: `llmlower serve` and vLLM's OpenAI server under vLLM's own serving benchmark, in one run.

The workload is vLLM's `bench serve` (benchmarks/peers/vllm_serving.py, run from the vLLM venv against each server in
turn): random prompts of 100 tokens, 128 output tokens each (EOS ignored), 48 requests, 16 at a time, streamed from
/v1/completions; the client runs on the same machine. llmlower serves an artifact of the model (--backend onnx or
tvm, --quant, its KV cache in --kv-cache-dtype; compiled once into --artifacts) with max_num_seqs = --concurrency;
vLLM's server the model's checkpoint in runner.native_dtype() (bf16 only where the CPU computes it). Both listen on
127.0.0.1 only and get --threads. Prints output tokens/s, TTFT p50/p99, TPOT p50 and inter-token p50/p99 for each,
and the ratios the targets use. With --rounds N the two servers take turns N times, each round starting with the one
that went second before (on a shared VM the machine drifts within minutes), and the ratios' medians over the rounds
close the report.

    bash benchmarks/peers/setup.sh vllm
    .venv/bin/python benchmarks/http_vs_vllm.py [--model example] [--backend onnx] [--quant q4mix]
        [--kv-cache-dtype auto] [--recipe fast] [--tvm-cpu rocketlake] [--vllm-without-amx] [--requests 48]
        [--concurrency 16] [--threads 2] [--rounds 1] [--artifacts DIR] [--json FILE]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from artifacts import ensure_artifact
from peers.runner import native_dtype, without_amx_environment
from serving import free_port, wait_healthy
from shaped_speed import machine

from llmlower.frontend import resolve_model
from llmlower.frontend.example import cache_dir
from llmlower.recipes import RECIPES
from llmlower.roofline import machine_ceilings

PEERS = Path(__file__).parent / "peers"
VLLM_PYTHON = PEERS / ".venv-vllm" / "bin" / "python"
SERVED_NAME = "model"
COLUMNS = (  # (label, result key, format)
    ("output tok/s", "output_throughput", "{:.1f}"),
    ("TTFT p50 ms", "median_ttft_ms", "{:.0f}"),
    ("TTFT p99 ms", "p99_ttft_ms", "{:.0f}"),
    ("TPOT p50 ms", "median_tpot_ms", "{:.1f}"),
    ("ITL p50 ms", "median_itl_ms", "{:.1f}"),
    ("ITL p99 ms", "p99_itl_ms", "{:.0f}"),
)


def llmlower_command(artifact: Path, port: int, args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    command = [sys.executable, "-m", "llmlower.cli", "serve", str(artifact), "--port", str(port)]
    command += ["--served-model-name", SERVED_NAME, "--threads", str(args.threads)]
    command += ["--max-num-seqs", str(args.concurrency), "--max-waiting", str(args.requests)]
    return command, dict(os.environ)


def vllm_command(checkpoint: Path, port: int, args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    command = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(checkpoint)]
    command += ["--served-model-name", SERVED_NAME, "--dtype", native_dtype(), "--host", "127.0.0.1"]
    command += ["--port", str(port), "--max-model-len", "1024", "--max-num-seqs", str(args.concurrency), "--seed", "0"]
    base = without_amx_environment() if args.vllm_without_amx else os.environ
    environment = {**base, "VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}"}
    return command, environment


def benchmark(name: str, command: list[str], environment: dict[str, str], url: str, args: argparse.Namespace) -> dict:
    """Start the server, wait for /health, run vLLM's serving benchmark against it, stop it; the result row."""
    print(f"[http] {name}: starting the server", file=sys.stderr)
    server = subprocess.Popen(command, env=environment, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_healthy(server, url, name, 600)
        print(f"[http] {name}: {args.requests} requests, {args.concurrency} at a time", file=sys.stderr)
        client = [str(VLLM_PYTHON), str(PEERS / "vllm_serving.py"), "--base-url", url, "--model", SERVED_NAME]
        client += ["--tokenizer", str(args.tokenizer), "--requests", str(args.requests)]
        client += ["--concurrency", str(args.concurrency)]
        done = subprocess.run(client, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"vllm_serving.py failed against {name} ({done.returncode}):\n{done.stderr[-4000:]}")
        row = json.loads([line for line in done.stdout.splitlines() if line.startswith("{")][-1])
    finally:
        server.terminate()
        server.wait(timeout=60)
    if row["failed"]:
        raise SystemExit(f"{name}: {row['failed']} of {args.requests} requests failed")
    return row


RATIOS = (("output throughput", "output_throughput"), ("TPOT p50", "median_tpot_ms"), ("TTFT p50", "median_ttft_ms"))


def ratios(ours: dict, theirs: dict) -> dict[str, float]:
    """Our figure over vLLM's, for each figure the targets use."""
    return {key: ours[key] / theirs[key] for _, key in RATIOS}


def describe(ratio: dict[str, float]) -> str:
    """The ratios as one line of the report."""
    return "; ".join(f"{label} {ratio[key]:.2f}x" for label, key in RATIOS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="example")
    parser.add_argument(
        "--backend", default="onnx", choices=("onnx", "tvm"), help="llmlower's backend for its artifact"
    )
    parser.add_argument("--quant", default="q4mix", help="llmlower's build_pipeline quant for its artifact")
    parser.add_argument("--kv-cache-dtype", default="auto", help="its KV cache: auto, float16 (tvm) or int8")
    parser.add_argument("--recipe", choices=list(RECIPES), help="a named recipe's artifact instead of --backend ...")
    parser.add_argument("--tvm-cpu", help="the LLVM CPU a tvm artifact is built for (rocketlake: AVX-512 without AMX)")
    parser.add_argument(
        "--vllm-without-amx",
        action="store_true",
        help="keep vLLM's server off AMX tiles (oneDNN capped at AVX-512 BF16, its AMX kernels not chosen)",
    )
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--rounds", type=int, default=1, help="turns of both servers, alternating which goes first")
    parser.add_argument("--artifacts", type=Path, default=cache_dir() / "bench" / "http")
    parser.add_argument("--json", help="also write the report here")
    args = parser.parse_args()
    if not VLLM_PYTHON.exists():
        raise SystemExit(f"{VLLM_PYTHON} is missing: run `bash benchmarks/peers/setup.sh vllm` first")
    checkpoint = resolve_model(args.model)  # a checkpoint directory: vLLM reads it, and its tokenizer files
    args.tokenizer = checkpoint
    options = {"quant": args.quant}
    cache = "" if args.kv_cache_dtype == "auto" else f"-kv-{args.kv_cache_dtype}"
    label = f"{args.backend}-{args.quant}{cache}"
    ours = f"{args.backend} {args.quant}{'' if args.kv_cache_dtype == 'auto' else f', {args.kv_cache_dtype} KV'}"
    if args.recipe:
        recipe = RECIPES[args.recipe]
        args.backend, args.kv_cache_dtype = recipe.backend, recipe.kv_cache_dtype
        options = recipe.pipeline_options
        label = ours = f"recipe {args.recipe}"
    built_for = {"cpu": args.tvm_cpu} if args.tvm_cpu and args.backend == "tvm" else None
    if built_for:
        label, ours = f"{label}-{args.tvm_cpu}", f"{ours} --cpu {args.tvm_cpu}"
    directory = args.artifacts / label.replace(" ", "-")
    artifact = ensure_artifact(
        str(checkpoint),
        args.backend,
        options,
        directory,
        kv_cache_dtype=args.kv_cache_dtype,
        compile_options=built_for,
    )
    ceilings = machine_ceilings("cpu")
    theirs = f"{native_dtype()}{', without AMX' if args.vllm_without_amx else ''}"
    ours_name, theirs_name = f"llmlower serve ({ours})", f"vLLM server ({theirs})"
    servers = [(ours_name, llmlower_command, artifact), (theirs_name, vllm_command, checkpoint)]
    rounds = []
    for index in range(args.rounds):
        rows = {}
        for name, make, model in servers if index % 2 == 0 else servers[::-1]:
            port = free_port()
            command, environment = make(model, port, args)
            rows[name] = benchmark(name, command, environment, f"http://127.0.0.1:{port}", args)
        rounds.append({"rows": rows, "ratios": ratios(rows[ours_name], rows[theirs_name])})
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"{machine(ceilings)}; {datetime.date.today()}, commit {commit}")
    workload = f"{args.requests} requests of 100 random tokens, 128 out, {args.concurrency} at a time"
    print(f"vLLM's serving benchmark: {workload}")
    print("| round | server | " + " | ".join(label for label, _, _ in COLUMNS) + " |")
    print("|---:|---|" + "---:|" * len(COLUMNS))
    for index, turn in enumerate(rounds, 1):
        for name in (ours_name, theirs_name):
            row = turn["rows"][name]
            print(f"| {index} | {name} | " + " | ".join(form.format(row[key]) for _, key, form in COLUMNS) + " |")
    for index, turn in enumerate(rounds, 1):
        print(f"round {index}, ours over vLLM's server: {describe(turn['ratios'])}")
    medians = {key: statistics.median(turn["ratios"][key] for turn in rounds) for _, key in RATIOS}
    if len(rounds) > 1:
        print(f"median of {len(rounds)} rounds: {describe(medians)}")
    if args.json:
        report = {"machine": machine(ceilings), "date": str(datetime.date.today()), "commit": commit}
        report.update(rounds=rounds, median_ratios=medians)
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
