"""Serving throughput and latency with N concurrent client streams, for llmlower's engines and ONNX Runtime GenAI.

Each of N streams is a client that sends a request, waits for it to finish and sends its next one (closed loop);
stream i starts at i x --stagger seconds. Prompts are SmolLM2 token ids cut from a fixed text
(tests/data/perplexity.txt) at seeded random offsets, each behind a tag of its own ("Request 7:"), with lengths drawn
uniformly from --prompt-tokens by a generator seeded with (--seed, N); a share of them (--shared-prefix) start with
the same --prefix-tokens system prompt (the text's first tokens) so that the prefix cache has something to hit; their
lengths are drawn from [prefix + 32, max]. Every request asks for --new-tokens greedy tokens, EOS ignored. The same
token ids go to every engine.

Engines: llmlower's torch reference (fp32; slow), its ONNX and TVM q4g32 artifacts (compiled once into --artifacts,
the directories speed.py uses, and reused), each driven by one thread that adds a request once its arrival time has
passed and calls step(); and ONNX Runtime GenAI int4 (benchmarks/peers/ortgenai_serving.py in the peers' venv), which
batches statically: waves of up to N arrived requests, each run to the end before the next starts. llmlower gets
max_num_seqs = N and a KV pool for N sequences of the longest prompt + new tokens (unless --kv-cache-memory).
Per (engine, N): output tokens/s (all output tokens over the wall time from the first arrival to the last token),
TTFT p50/p99 and end-to-end p50 (from the request's arrival time, which includes waiting for a step or a wave to
end), inter-token latency p50/p99 (every gap of every request), the prefix cache's hit rate (prompt tokens found /
looked up) and preemptions. All times are taken by the driving loop, the same way for every engine.

    .venv/bin/python benchmarks/serving.py [--streams 1,4,16,64] [--requests-per-stream 2] [--stagger 0.05]
        [--shared-prefix 0.5] [--prefix-tokens 400] [--prompt-tokens 100,600] [--new-tokens 128] [--seed 0]
        [--max-num-batched-tokens 128] [--kv-cache-memory BYTES] [--threads 2] [--model example]
        [--artifacts DIR] [--rebuild] [--only torch,onnx,tvm,ortgenai] [--json FILE] [--plot FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import numpy as np
from artifacts import ensure_artifact

from llmlower.frontend.example import cache_dir, example_checkpoint
from llmlower.runtime import Engine
from llmlower.runtime.sampling_params import SamplingParams
from llmlower.runtime.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parent.parent
PEERS = ROOT / "benchmarks" / "peers"
TEXT = ROOT / "tests" / "data" / "perplexity.txt"
ENGINES = {  # --only key -> row name
    "torch": "llmlower torch fp32",
    "onnx": "llmlower onnx q4g32",
    "http": "llmlower onnx q4g32 over HTTP",
    "tvm": "llmlower tvm q4g32",
    "ortgenai": "ORT GenAI int4",
}
# key -> (directory, backend), as in speed.py; "http" serves the onnx artifact with `llmlower serve`
ARTIFACTS = {"onnx": ("q4g32", "onnx"), "http": ("q4g32", "onnx"), "tvm": ("tvm-q4g32", "tvm")}
QUANT = {"quant": "q4g32"}
MIN_TAIL = 32  # tokens after the shared system prompt, at least


@dataclass(frozen=True)
class Workload:
    """What N streams send: each stream's prompts in order, and when the streams start."""

    streams: list[list[list[int]]]
    shared: int  # prompts that start with the system prompt
    stagger_s: float
    new_tokens: int

    @property
    def prompts(self) -> list[list[int]]:
        return [ids for stream in self.streams for ids in stream]


@dataclass
class Record:
    """One request as its client saw it: times in seconds from the start of the run."""

    stream: int
    prompt_tokens: int
    arrival_s: float
    token_times_s: list[float] = field(default_factory=list)
    cached_tokens: int = 0


class Skipped(Exception):
    """An engine that cannot run here (not set up, fails to compile or to load)."""


# ---------------------------------------------------------------- workload


def make_workload(text: list[int], tag: Callable[[int], list[int]], n: int, args: argparse.Namespace) -> Workload:
    """N streams of --requests-per-stream prompts each, drawn by a generator seeded with (seed, N)."""
    rng = np.random.default_rng([args.seed, n])
    low, high = args.prompt_tokens
    system, body = text[: args.prefix_tokens], text + text  # body: any offset below len(text) has room
    streams, shared, k = [], 0, 0
    for _ in range(n):
        prompts = []
        for _ in range(args.requests_per_stream):
            is_shared = bool(rng.random() < args.shared_prefix)
            length = int(rng.integers(max(low, len(system) + MIN_TAIL) if is_shared else low, high + 1))
            head = (system if is_shared else []) + tag(k)
            offset = int(rng.integers(len(text)))
            prompts.append(head + body[offset : offset + length - len(head)])
            shared += is_shared
            k += 1
        streams.append(prompts)
    return Workload(streams, shared, args.stagger, args.new_tokens)


def describe(workload: Workload, args: argparse.Namespace) -> str:
    """One line saying what the streams send."""
    lengths = [len(ids) for ids in workload.prompts]
    return (
        f"N={len(workload.streams)}: {len(lengths)} requests ({args.requests_per_stream} per stream, stream i starts "
        f"at i x {args.stagger} s), prompts {min(lengths)}-{max(lengths)} tokens (mean {np.mean(lengths):.0f}); "
        f"{workload.shared} start with the same {args.prefix_tokens}-token system prompt; "
        f"{workload.new_tokens} new tokens each (greedy, EOS ignored)"
    )


# ---------------------------------------------------------------- llmlower


def load_limits(n: int, args: argparse.Namespace) -> dict:
    """The engine's limits for N streams: max_num_seqs = N, and the serving limits of the command line."""
    return {
        "max_num_seqs": n,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_context": args.prompt_tokens[1] + args.new_tokens,
        "kv_cache_memory": args.kv_cache_memory,
    }


def load_llmlower(key: str, n: int, args: argparse.Namespace, artifact: Path | None) -> Engine:
    """An engine of `key` for N streams (load_limits)."""
    limits = load_limits(n, args)
    if key == "torch":
        import torch

        from llmlower.api import load_engine

        torch.set_num_threads(args.threads)
        return load_engine(args.model, **limits)
    return Engine.load(artifact, threads=args.threads, **limits)


def warm_up(engine: Engine, tokens: int) -> None:
    """A few decode steps after a prompt of `tokens` made-up ids (none of the workload's prefixes), so that the timed
    run does not pay for first-run allocations; the prefix-cache counters are read around the timed run."""
    prompt = [10 + i % 1000 for i in range(tokens)]
    engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))


def drive(engine: Engine, workload: Workload) -> list[Record]:
    """Serve the streams in real time from this thread: add each request once its arrival time has passed, step,
    and time every token as the step that made it returns."""
    params = SamplingParams(temperature=0.0, max_tokens=workload.new_tokens, ignore_eos=True)
    next_index = [0] * len(workload.streams)
    arrival = {i: i * workload.stagger_s for i in range(len(workload.streams))}  # stream -> its next request's
    active: dict[str, Record] = {}
    records: list[Record] = []
    start = time.perf_counter()
    while arrival or active:
        now = time.perf_counter() - start
        for i, at in sorted(arrival.items(), key=lambda item: item[1]):
            if at <= now:
                ids = workload.streams[i][next_index[i]]
                request_id = engine.add_request(ids, params, request_id=f"s{i}-r{next_index[i]}")
                active[request_id] = Record(i, len(ids), at)
                del arrival[i]
        if not active:
            time.sleep(max(0.0, min(arrival.values()) - now))
            continue
        deltas = engine.step()
        now = time.perf_counter() - start
        for delta in deltas:
            record = active[delta.request_id]
            record.token_times_s.append(now)
            if delta.finish_reason is not None:
                record.cached_tokens = delta.result.usage.cached_tokens
                records.append(active.pop(delta.request_id))
                next_index[record.stream] += 1
                if next_index[record.stream] < len(workload.streams[record.stream]):
                    arrival[record.stream] = now  # the client sends its next request at once
    return records


def run_llmlower(key: str, workload: Workload, args: argparse.Namespace, artifact: Path | None) -> dict:
    """One (engine, N) row of an llmlower engine."""
    engine = load_llmlower(key, len(workload.streams), args, artifact)
    warm_up(engine, args.max_num_batched_tokens)
    before = engine.stats()
    records = drive(engine, workload)
    after = engine.stats()
    queries = after.prefix_cache_queries - before.prefix_cache_queries
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    row = summarize(records, workload.new_tokens)
    row["prefix_cache_hit_rate"] = hits / queries if queries else 0.0
    row["preemptions"] = after.preemptions - before.preemptions
    row["kv_blocks"] = engine.executor.num_blocks
    del engine
    gc.collect()
    return row


# ---------------------------------------------------------------- llmlower over HTTP


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(artifact: Path, n: int, args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    """`llmlower serve ARTIFACT` on a free port of 127.0.0.1 with the in-process engine's limits; returns the
    process and the URL once /health answers."""
    port = free_port()
    limits = load_limits(n, args)
    command = [sys.executable, "-m", "llmlower.cli", "serve", str(artifact), "--port", str(port)]
    command += ["--threads", str(args.threads), "--max-waiting", str(n * args.requests_per_stream)]
    for name, value in limits.items():
        if value is not None:
            command += [f"--{name.replace('_', '-')}", str(value)]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(process, url, "llmlower serve", 120)
    return process, url


def wait_healthy(process: subprocess.Popen, url: str, name: str, timeout_s: float) -> None:
    """Return once the server at url answers /health with 200; kill it and raise Skipped if it exits first or
    does not answer within timeout_s."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.2)
    process.kill()
    raise Skipped(f"{name} did not start (exit {process.wait()})")


async def drive_http(url: str, model: str, workload: Workload) -> list[Record]:
    """N asyncio clients, each streaming its requests from /v1/completions one after the other (token ids in,
    one server-sent event per token out), timed as drive() times the in-process engine."""
    start = time.perf_counter()
    limits = httpx.Limits(max_connections=len(workload.streams) + 4)

    async def client(http: httpx.AsyncClient, stream: int) -> list[Record]:
        await asyncio.sleep(stream * workload.stagger_s)
        records = []
        for ids in workload.streams[stream]:
            record = Record(stream, len(ids), time.perf_counter() - start)
            body = {"model": model, "prompt": ids, "max_tokens": workload.new_tokens, "temperature": 0.0}
            body.update(ignore_eos=True, stream=True)
            async with http.stream("POST", "/v1/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        record.token_times_s.append(time.perf_counter() - start)
            records.append(record)
        return records

    async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as http:
        per_stream = await asyncio.gather(*(client(http, i) for i in range(len(workload.streams))))
    return [record for records in per_stream for record in records]


def server_counters(url: str) -> dict[str, float]:
    """The server's /metrics samples (the counters the in-process rows read from engine.stats())."""
    from prometheus_client.parser import text_string_to_metric_families

    families = text_string_to_metric_families(httpx.get(f"{url}/metrics").text)
    return {sample.name: sample.value for family in families for sample in family.samples}


def run_http(workload: Workload, args: argparse.Namespace, artifact: Path) -> dict:
    """One (engine, N) row of the onnx artifact behind `llmlower serve`, driven over HTTP from this process."""
    process, url = start_server(artifact, len(workload.streams), args)
    try:
        warm_up_prompt = [10 + i % 1000 for i in range(args.max_num_batched_tokens)]
        body = {"model": artifact.name, "prompt": warm_up_prompt, "max_tokens": 4, "ignore_eos": True}
        httpx.post(f"{url}/v1/completions", json=body, timeout=120).raise_for_status()
        before = server_counters(url)
        records = asyncio.run(drive_http(url, artifact.name, workload))
        after = server_counters(url)
    finally:
        process.terminate()
        process.wait(timeout=60)
    queries = after["llmlower:prefix_cache_queries_total"] - before["llmlower:prefix_cache_queries_total"]
    hits = after["llmlower:prefix_cache_hits_total"] - before["llmlower:prefix_cache_hits_total"]
    row = summarize(records, workload.new_tokens)
    row["prefix_cache_hit_rate"] = hits / queries if queries else 0.0
    row["preemptions"] = int(after["llmlower:num_preemptions_total"] - before["llmlower:num_preemptions_total"])
    return row


# ---------------------------------------------------------------- ONNX Runtime GenAI


def run_ortgenai(workload: Workload, args: argparse.Namespace) -> dict:
    """One row of ORT GenAI: benchmarks/peers/ortgenai_serving.py in the peers' venv serves the same workload."""
    python = PEERS / ".venv-ortgenai" / "bin" / "python"
    model = cache_dir() / "peers" / "ortgenai-int4"
    if args.model != "example":
        raise Skipped("its int4 model is built from the example checkpoint only")
    if not python.exists() or not (model / "genai_config.json").exists():
        raise Skipped(f"no {python} or {model}: run bash benchmarks/peers/setup.sh ortgenai")
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(asdict(workload), f)
        f.flush()
        command = [str(python), str(PEERS / "ortgenai_serving.py"), "--model", str(model), "--workload", f.name]
        command += ["--max-batch", str(len(workload.streams)), "--threads", str(args.threads)]
        done = subprocess.run(command, stdout=subprocess.PIPE, text=True)  # its progress goes to our stderr
    if done.returncode != 0:
        raise Skipped(f"ortgenai_serving.py exited with {done.returncode}")
    out = json.loads(done.stdout.strip().splitlines()[-1])
    records = [Record(r["stream"], r["prompt_tokens"], r["arrival_s"], r["token_times_s"]) for r in out["records"]]
    row = summarize(records, workload.new_tokens)
    row.update(prefix_cache_hit_rate=None, preemptions=None, waves=out["waves"], version=out["version"])
    return row


# ---------------------------------------------------------------- metrics and output


def percentile(values: list[float] | np.ndarray, q: float) -> float:
    """The q-th percentile (linear interpolation), or nan for no values."""
    return float(np.percentile(values, q)) if len(values) else float("nan")


def summarize(records: list[Record], new_tokens: int) -> dict:
    """Throughput and latency percentiles of one run's requests."""
    for record in records:
        if len(record.token_times_s) != new_tokens:
            raise RuntimeError(f"stream {record.stream}: {len(record.token_times_s)} tokens, not {new_tokens}")
    first = min(r.arrival_s for r in records)
    wall = max(r.token_times_s[-1] for r in records) - first
    ttft = [r.token_times_s[0] - r.arrival_s for r in records]
    e2e = [r.token_times_s[-1] - r.arrival_s for r in records]
    gaps = np.concatenate([np.diff(r.token_times_s) for r in records])
    output = sum(len(r.token_times_s) for r in records)
    prompt = sum(r.prompt_tokens for r in records)
    return {
        "requests": len(records),
        "prompt_tokens": prompt,
        "output_tokens": output,
        "wall_s": wall,
        "output_tokens_per_s": output / wall,
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "itl_p50_s": percentile(gaps, 50),
        "itl_p99_s": percentile(gaps, 99),
        "e2e_p50_s": percentile(e2e, 50),
        "cached_prompt_share": sum(r.cached_tokens for r in records) / prompt,
    }


def with_ratios(rows: list[dict]) -> list[dict]:
    """Each llmlower row gets its throughput over ORT GenAI's at the same N (when that row ran)."""
    peer = {
        r["streams"]: r["output_tokens_per_s"] for r in rows if r["engine"] == ENGINES["ortgenai"] and "wall_s" in r
    }
    for row in rows:
        if "wall_s" in row and row["engine"] != ENGINES["ortgenai"] and row["streams"] in peer:
            row["vs_ortgenai"] = row["output_tokens_per_s"] / peer[row["streams"]]
    return rows


def print_table(rows: list[dict]) -> None:
    """The rows as a markdown table, by N, then engine; skipped rows say why."""
    print(
        "| engine | N | requests | output tok/s | vs ORT GenAI | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms "
        "| e2e p50 s | prefix-cache hits | preemptions |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for row in sorted(rows, key=lambda r: (r["streams"], list(ENGINES.values()).index(r["engine"]))):
        if "wall_s" not in row:
            print(f"| {row['engine']} | {row['streams']} | skipped: {row['skipped']} |" + " |" * 9)
            continue
        ratio = f"{row['vs_ortgenai']:.2f}x" if "vs_ortgenai" in row else "-"
        hits = "-" if row["prefix_cache_hit_rate"] is None else f"{row['prefix_cache_hit_rate']:.0%}"
        preemptions = "-" if row["preemptions"] is None else str(row["preemptions"])
        print(
            f"| {row['engine']} | {row['streams']} | {row['requests']} | {row['output_tokens_per_s']:.1f} | {ratio} "
            f"| {row['ttft_p50_s'] * 1e3:.0f} | {row['ttft_p99_s'] * 1e3:.0f} | {row['itl_p50_s'] * 1e3:.1f} "
            f"| {row['itl_p99_s'] * 1e3:.1f} | {row['e2e_p50_s']:.1f} | {hits} | {preemptions} |"
        )


def plot(rows: list[dict], path: str) -> None:
    """Output tokens/s against N, one line per engine, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6.4, 4.2))
    for engine in ENGINES.values():
        points = sorted(
            (r["streams"], r["output_tokens_per_s"]) for r in rows if r["engine"] == engine and "wall_s" in r
        )
        if points:
            axes.plot(*zip(*points, strict=True), marker="o", label=engine)
    streams = sorted({r["streams"] for r in rows})
    axes.set_xscale("log", base=2)
    axes.set_xticks(streams, [str(n) for n in streams])
    axes.set(xlabel="concurrent streams N", ylabel="output tokens/s", title="Serving throughput (SmolLM2-135M, CPU)")
    axes.grid(True, alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def load_line(label: str) -> str:
    """The machine's load averages, for the record."""
    one, five, fifteen = os.getloadavg()
    return f"load average at {label}: {one:.2f} {five:.2f} {fifteen:.2f} ({os.cpu_count()} CPUs)"


# ---------------------------------------------------------------- main


def parse_args() -> argparse.Namespace:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", default="1,4,16,64", help="comma-separated numbers of concurrent streams")
    parser.add_argument("--requests-per-stream", type=int, default=2)
    parser.add_argument("--stagger", type=float, default=0.05, help="stream i starts at i x this many seconds")
    parser.add_argument("--shared-prefix", type=float, default=0.5, help="share of prompts behind the system prompt")
    parser.add_argument("--prefix-tokens", type=int, default=400, help="length of the shared system prompt")
    parser.add_argument("--prompt-tokens", default="100,600", help="MIN,MAX prompt length")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-num-batched-tokens", type=int, default=128)
    parser.add_argument("--kv-cache-memory", type=int, help="KV pool bytes (default: N sequences of the longest)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", default="example")
    parser.add_argument("--artifacts", type=Path, help="where the artifacts are compiled and reused")
    parser.add_argument("--rebuild", action="store_true", help="compile the artifacts even if present")
    parser.add_argument("--only", help=f"comma-separated engines to run, of {','.join(ENGINES)} (default: all)")
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--plot", help="also plot throughput against N into this PNG")
    args = parser.parse_args()
    args.streams = [int(n) for n in args.streams.split(",")]
    args.prompt_tokens = tuple(int(n) for n in args.prompt_tokens.split(","))
    args.only = args.only.split(",") if args.only else list(ENGINES)
    unknown = set(args.only) - set(ENGINES)
    if unknown:
        parser.error(f"--only {','.join(sorted(unknown))}: the engines are {','.join(ENGINES)}")
    low, high = args.prompt_tokens
    if not 0 < low <= high or args.shared_prefix and args.prefix_tokens + MIN_TAIL > high:
        parser.error(f"--prompt-tokens {low},{high} cannot hold a {args.prefix_tokens}-token prefix and a tail")
    return args


def text_and_tags(args: argparse.Namespace) -> tuple[list[int], Callable[[int], list[int]]]:
    """The fixed text's token ids and the tag that makes prompt k unique, from the model's tokenizer."""
    checkpoint = example_checkpoint() if args.model == "example" else Path(args.model)
    tokenizer = Tokenizer.from_dir(checkpoint)
    text = tokenizer.encode(TEXT.read_text(), add_special_tokens=False)
    if len(text) < max(args.prompt_tokens[1], args.prefix_tokens):
        raise SystemExit(f"{TEXT} has {len(text)} tokens, fewer than a prompt needs")

    def tag(k: int) -> list[int]:
        return tokenizer.encode(f"\nRequest {k}: ", add_special_tokens=False)

    return text, tag


def prefix_ttft(engine: Engine, text: list[int], tag: Callable[[int], list[int]], prefix: int) -> dict:
    """TTFT of a request behind a `prefix`-token system prompt nobody sent before, then of another request behind
    the same system prompt (now cached); medians over three system prompts taken from the text."""
    params = SamplingParams(temperature=0.0, max_tokens=1)
    cold, cached = [], []
    for k in range(3):
        start = (k + 1) * len(text) // 4 - prefix // 2  # away from the workload's own system prompt
        system = text[start : start + prefix]
        for times, question in ((cold, 10_000 + 2 * k), (cached, 10_001 + 2 * k)):
            times.append(engine.generate([system + tag(question)], params)[0].timing.ttft_s)
    return {"cold_ms": float(np.median(cold)) * 1e3, "cached_ms": float(np.median(cached)) * 1e3}


def workloads(args: argparse.Namespace, text: list[int], tag: Callable[[int], list[int]]) -> dict[int, Workload]:
    """The workload of every N."""
    return {n: make_workload(text, tag, n, args) for n in args.streams}


def run_engine(key: str, loads: dict[int, Workload], args: argparse.Namespace) -> list[dict]:
    """Every N of one engine; an engine that cannot run is a skipped row with the error, per N."""
    rows = []
    artifact, compile_error = None, None
    for n, workload in loads.items():
        row = {"engine": ENGINES[key], "streams": n, "load_at_start": os.getloadavg()}
        print(f"[serving] {ENGINES[key]}, N={n}", file=sys.stderr)
        try:
            if key == "ortgenai":
                row.update(run_ortgenai(workload, args))
            elif key == "http":
                if artifact is None:
                    directory = (args.artifacts or cache_dir() / "bench" / Path(args.model).name) / ARTIFACTS[key][0]
                    artifact = ensure_artifact(args.model, ARTIFACTS[key][1], QUANT, directory, args.rebuild)
                row.update(run_http(workload, args, artifact))
            else:
                if compile_error:
                    raise Skipped(compile_error)
                if key in ARTIFACTS and artifact is None:
                    directory = (args.artifacts or cache_dir() / "bench" / Path(args.model).name) / ARTIFACTS[key][0]
                    try:
                        artifact = ensure_artifact(args.model, ARTIFACTS[key][1], QUANT, directory, args.rebuild)
                    except Exception as error:
                        compile_error = f"compile failed: {one_line(error)}"  # not retried for the next N
                        raise
                row.update(run_llmlower(key, workload, args, artifact))
                if n == max(loads) and args.shared_prefix:  # only then do prompts hold room for the prefix
                    engine = load_llmlower(key, 1, args, artifact)
                    row["prefix_ttft"] = prefix_ttft(engine, *text_and_tags(args), args.prefix_tokens)
        except Exception as error:  # a failing engine is a row of the report, not the end of the run
            if not isinstance(error, Skipped):
                traceback.print_exc(file=sys.stderr)
            row["skipped"] = compile_error or one_line(error)
        rows.append(row)
    return rows


def one_line(error: BaseException) -> str:
    """The first line of the error's message (after its type unless Skipped), at most 200 characters."""
    message = str(error).splitlines()[0] if str(error) else ""
    return (message if isinstance(error, Skipped) else f"{type(error).__name__}: {message}")[:200]


def main() -> None:
    """Build the workloads, run every engine at every N, print and save the results."""
    args = parse_args()
    print(load_line("start"))
    loads = workloads(args, *text_and_tags(args))
    for workload in loads.values():
        print(describe(workload, args))
    print(
        f"{args.threads} threads everywhere; llmlower: max_num_seqs = N, max_num_batched_tokens = "
        f"{args.max_num_batched_tokens}, prefix caching on; ORT GenAI: static batches (waves) of up to N requests"
    )
    rows = []
    for key in args.only:
        rows += run_engine(key, loads, args)
    rows = with_ratios(rows)
    end = load_line("end")
    print_table(rows)
    in_process = {r["streams"]: r for r in rows if r["engine"] == ENGINES["onnx"] and "wall_s" in r}
    for row in rows:
        if row["engine"] == ENGINES["http"] and "wall_s" in row and row["streams"] in in_process:
            share = row["output_tokens_per_s"] / in_process[row["streams"]]["output_tokens_per_s"]
            print(f"N={row['streams']}: over HTTP {row['output_tokens_per_s']:.1f} tok/s, {share:.0%} of in-process")
    for row in rows:
        if "prefix_ttft" in row:
            cold, cached = row["prefix_ttft"]["cold_ms"], row["prefix_ttft"]["cached_ms"]
            print(
                f"{row['engine']}: first token of a request behind a {args.prefix_tokens}-token system prompt "
                f"{cold:.0f} ms, behind the same prompt once cached {cached:.0f} ms ({cold / cached:.1f}x sooner)"
            )
    print(end)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if k != "artifacts"}, "rows": rows}, f, indent=2)
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
