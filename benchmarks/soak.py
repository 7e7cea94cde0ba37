"""Soak: `llmlower serve` under mixed traffic from many clients for minutes, on 127.0.0.1 only.

The server (a subprocess, `--speculative ngram` so that every request goes through prompt lookup) serves an artifact
while --clients threads each send one request after another until --minutes have passed, each request of a kind
drawn at random: a streamed chat, a completion with n = 2, a JSON-schema chat, a stream the client cancels after a
few chunks, a bad request (must get a 400), a hostile one (top_k = 2**63, a subnormal temperature: must be served),
and one past a per-request limit (must get a 400). Reported per minute: requests served, errors by kind, p50/p99
latency, the server's resident memory; at the end: the KV blocks in use once idle (must be 0) and the server's own
request counters against the clients' counts. Not part of the tests: it runs for minutes.

    .venv/bin/python benchmarks/soak.py ARTIFACT [--clients 32] [--minutes 10] [--seed 0] [--json FILE] [--plot FILE]
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

MODEL = "soak"
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
KINDS = {  # kind -> share of the traffic
    "stream": 0.3,
    "n2": 0.15,
    "json": 0.15,
    "cancel": 0.15,
    "bad": 0.1,
    "hostile": 0.1,
    "over_limit": 0.05,
}
EXPECTED = {"bad": 400, "over_limit": 400}  # the status these kinds must get; every other kind must be served
COMPLETIONS = {
    "n2": 2,
    "bad": 0,
    "over_limit": 0,
}  # completions a served request of the kind ends on the server (else 1)


@dataclass
class Outcome:
    kind: str
    started: float  # seconds since the soak began
    seconds: float
    status: int | str  # 200, the HTTP status of an error, or the exception's name
    ok: bool  # what this kind must get


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(artifact: Path, port: int, log: Path) -> subprocess.Popen:
    command = [sys.executable, "-m", "llmlower.cli", "serve", str(artifact), "--port", str(port)]
    command += ["--served-model-name", MODEL, "--speculative", "ngram", "--max-num-seqs", "16"]
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return process
        except httpx.TransportError:
            time.sleep(0.2)
    process.kill()
    raise SystemExit(f"the server did not start:\n{log.read_text()}")


def one_request(client: openai.OpenAI, kind: str, rng: random.Random) -> int:
    """Send one request of `kind`; its HTTP status (200 when served)."""
    user = [{"role": "user", "content": f"Tell me about the number {rng.randint(0, 10**6)}."}]
    max_tokens = rng.randint(8, 64)
    if kind in ("stream", "cancel"):
        chunks = client.chat.completions.create(model=MODEL, messages=user, max_tokens=max_tokens, stream=True)
        for seen, _ in enumerate(chunks):
            if kind == "cancel" and seen == 3:
                chunks.close()  # the client goes away mid-stream
                break
    elif kind == "n2":
        client.completions.create(model=MODEL, prompt=user[0]["content"], max_tokens=max_tokens, n=2)
    elif kind == "json":
        schema = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
        reply = client.chat.completions.create(model=MODEL, messages=user, max_tokens=48, response_format=schema)
        if reply.choices[0].finish_reason == "stop":
            json.loads(reply.choices[0].message.content)
    elif kind == "hostile":
        extra = {"top_k": 2**63} if rng.random() < 0.5 else {}
        temperature = 5e-324 if not extra else 1.0
        client.completions.create(
            model=MODEL, prompt="keys and values", max_tokens=max_tokens, temperature=temperature, extra_body=extra
        )
    elif kind == "bad":
        client.chat.completions.create(model=MODEL, messages=user, max_tokens=max_tokens, top_p=2.0)
    elif kind == "over_limit":
        client.completions.create(model=MODEL, prompt="x", max_tokens=4, stop=[f"s{i}" for i in range(64)])
    return 200


def client_loop(url: str, seed: int, until: float, began: float, outcomes: list[Outcome]) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    rng = random.Random(seed)
    kinds, weights = zip(*KINDS.items(), strict=True)
    while time.monotonic() < until:
        kind = rng.choices(kinds, weights)[0]
        started = time.monotonic()
        try:
            status: int | str = one_request(client, kind, rng)
        except openai.APIStatusError as error:
            status = error.status_code
        except Exception as error:  # a dropped connection, a timeout: counted by name
            status = type(error).__name__
        outcomes.append(Outcome(kind, started - began, time.monotonic() - started, status, _ok(kind, status)))


def _ok(kind: str, status: int | str) -> bool:
    return status == EXPECTED.get(kind, 200)


def resident_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def server_metrics(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics").text
    samples = (s for family in text_string_to_metric_families(text) for s in family.samples)
    return {s.name + "".join(f"{{{v}}}" for k, v in s.labels.items() if k != "model_name"): s.value for s in samples}


def per_minute(outcomes: list[Outcome], memory: dict[int, float]) -> list[dict]:
    rows = []
    for minute in sorted({int(o.started // 60) for o in outcomes}):
        here = [o for o in outcomes if int(o.started // 60) == minute]
        served = sorted(o.seconds for o in here if o.status == 200)
        errors = collections.Counter(str(o.status) for o in here if o.status != 200)
        rows.append(
            {
                "minute": minute + 1,
                "requests": len(here),
                "served": len(served),
                "unexpected": sum(not o.ok for o in here),
                "errors": dict(errors),
                "p50_s": statistics.median(served) if served else None,
                "p99_s": served[min(len(served) - 1, int(0.99 * len(served)))] if served else None,
                "rss_mb": memory.get(minute),
            }
        )
    return rows


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    minutes = [r["minute"] for r in rows]
    figure, (latency, memory) = plt.subplots(1, 2, figsize=(10, 3.5))
    latency.plot(minutes, [r["p50_s"] for r in rows], marker="o", label="p50")
    latency.plot(minutes, [r["p99_s"] for r in rows], marker="o", label="p99")
    latency.set(xlabel="minute", ylabel="latency of served requests (s)", title="latency")
    latency.legend()
    memory.plot(minutes, [r["rss_mb"] for r in rows], marker="o")
    memory.set(xlabel="minute", ylabel="server RSS (MB)", title="resident memory")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--minutes", type=float, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the report here")
    parser.add_argument("--plot", help="plot latency and memory per minute here (PNG)")
    args = parser.parse_args()
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = Path(tempfile.mkdtemp(prefix="llmlower-soak-")) / "server.log"
    server = start_server(args.artifact, port, log)
    memory = {-1: resident_mb(server.pid)}
    outcomes: list[Outcome] = []
    began = time.monotonic()
    until = began + args.minutes * 60
    threads = [
        threading.Thread(target=client_loop, args=(url, args.seed * 1000 + i, until, began, outcomes), daemon=True)
        for i in range(args.clients)
    ]
    try:
        for thread in threads:
            thread.start()
        while any(thread.is_alive() for thread in threads):
            time.sleep(1)
            minute = int((time.monotonic() - began) // 60)
            memory[minute] = resident_mb(server.pid)
            print(f"\r[soak] {time.monotonic() - began:6.0f} s, {len(outcomes)} requests", end="", file=sys.stderr)
        print(file=sys.stderr)
        time.sleep(2)  # cancelled streams' aborts reach the engine
        metrics = server_metrics(url)
    finally:
        server.terminate()
        server.wait(timeout=60)
    rows = per_minute(outcomes, memory)
    served = sum(o.status == 200 for o in outcomes)
    counted = sum(v for k, v in metrics.items() if k.startswith("llmlower:request_success_total"))
    report = {
        "clients": args.clients,
        "minutes": args.minutes,
        "requests": len(outcomes),
        "served": served,
        "unexpected": [asdict(o) for o in outcomes if not o.ok][:20],
        "by_kind": dict(collections.Counter(o.kind for o in outcomes)),
        "per_minute": rows,
        "rss_mb_start_end": [memory[-1], memory[max(memory)]],
        "kv_blocks_used_at_end": metrics.get("llmlower:kv_cache_blocks_used"),
        "running_waiting_at_end": [
            metrics.get("llmlower:num_requests_running"),
            metrics.get("llmlower:num_requests_waiting"),
        ],
        "server_finished_completions": counted,
        "client_completions": sum(COMPLETIONS.get(o.kind, 1) for o in outcomes if o.status == 200),
        "server_log": str(log),
    }
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
