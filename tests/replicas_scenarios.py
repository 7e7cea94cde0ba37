"""`llmlower serve --replicas N` on Ray Serve, live on 127.0.0.1 (run by tests/test_replicas.py in a network
namespace of its own, since Ray's processes listen on every interface): two local replicas of a tiny Llama ONNX artifact
behind Ray's proxy, spoken to with the real `openai` client; what they answer is what one in-process engine
answers, both replicas serve, errors keep OpenAI's envelope; a blocking run (what the CLI runs) stops on SIGTERM.
The tests that start a Ray instance of their own come first: the module's replicas start with the first test
that needs them, and one Ray instance runs at a time."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

NEEDS_RAY = "`ray` cannot be imported: --replicas needs the replicas extra (pip install 'llmlower[replicas]')"
pytest.importorskip("ray", reason=NEEDS_RAY, exc_type=ImportError)
pytest.importorskip("ray.serve", reason=NEEDS_RAY, exc_type=ImportError)

import ray  # noqa: E402
from ray import serve  # noqa: E402

from llmlower.cli import main  # noqa: E402
from llmlower.errors import LlmlowerError  # noqa: E402
from llmlower.runtime import Engine, EngineConfig, SamplingParams  # noqa: E402
from llmlower.serve import ServerConfig  # noqa: E402
from llmlower.serve.replicas import REPLICA_HEADER, run_replicas  # noqa: E402
from tests.ports import free_port  # noqa: E402
from tests.test_replicas import ARTIFACT_VARIABLE  # noqa: E402

pytestmark = pytest.mark.slow

KEY = "replica-key"
MODEL = "tiny"
MAX_TOKENS = 12
QUESTIONS = [f"Question {i}: what comes after {i} and {i + 1}?" for i in range(8)]
ENGINE = EngineConfig(max_num_seqs=8, max_context=128)


@pytest.fixture(scope="module")
def artifact(request, tmp_path_factory) -> Path:
    """The tiny Llama's ONNX artifact: the one tests/test_replicas.py names in ARTIFACT_VARIABLE (its run's, built
    already), else compiled here."""
    if given := os.environ.get(ARTIFACT_VARIABLE):
        return Path(given)
    out = tmp_path_factory.mktemp("replicas") / "tiny-onnx"
    assert main(["compile", str(request.getfixturevalue("tiny_llama")), "-o", str(out), "--recipe", "exact"]) == 0
    return out


@pytest.fixture(scope="module")
def url(artifact) -> Iterator[str]:
    """Two replicas (one thread each) on a fresh local Ray instance, shut down at the end whatever happens."""
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("RAY_ADDRESS", raising=False)  # never join a cluster someone else runs
        patch.setenv("RAY_USAGE_STATS_ENABLED", "0")
        assert not ray.is_initialized()
        try:
            running = run_replicas(
                artifact, ENGINE, ServerConfig(MODEL, KEY), replicas=2, port=free_port(), threads=1, blocking=False
            )
            with running:
                yield running.url
        finally:
            if ray.is_initialized():
                with contextlib.suppress(Exception):
                    serve.shutdown()
                ray.shutdown()
    assert not ray.is_initialized()


@pytest.fixture(scope="module")
def expected(artifact) -> list[str]:
    """The greedy texts of a single in-process engine (the chat template applied to each question)."""
    engine = Engine.load(artifact, ENGINE, threads=1)
    results = engine.generate(QUESTIONS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    return [r.text for r in results]


def _wait_for(condition, what: str, log: Path, process: subprocess.Popen, timeout: float = 120):
    deadline = time.monotonic() + timeout
    while not (found := condition(log.read_text())):
        if process.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen:\n{log.read_text()}")
        time.sleep(0.2)
    return found


def _replica_pids(log: str) -> list[int] | None:
    """The process ids of the replicas that printed their start-up line, once two have."""
    pids = [int(pid) for pid in re.findall(r"llmlower replica \w+ \(pid (\d+)\)", log)]
    return pids if len(set(pids)) == 2 else None


def test_a_blocking_run_serves_until_sigterm_without_torch(artifact, tmp_path):
    """`llmlower serve ARTIFACT --replicas 2`: it serves until SIGTERM, then deletes the replicas, stops its
    local Ray and returns; the replica processes never load torch. (First in this module: before the module's
    replicas start, so that one Ray instance runs at a time.)"""
    port, log = free_port(), tmp_path / "serve.log"
    env = {name: value for name, value in os.environ.items() if name != "RAY_ADDRESS"}  # never join a cluster
    env |= {"RAY_USAGE_STATS_ENABLED": "0", "RAY_DEDUP_LOGS": "0"}  # RAY_DEDUP_LOGS: each replica's line shows
    with open(log, "w") as out:
        command = [sys.executable, "-m", "llmlower.cli", "serve", str(artifact), "--port", str(port)]
        command += ["--replicas", "2", "--threads", "1", "--served-model-name", "tiny", "--max-context", "128"]
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        _wait_for(lambda text: "replicas serving at" in text, "serving", log, process)
        pids = _wait_for(_replica_pids, "the two replicas' start-up lines", log, process, timeout=30)
        for pid in pids:
            maps = Path(f"/proc/{pid}/maps").read_text()
            assert "onnxruntime" in maps and "libtorch" not in maps, pid
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60)
        reply = client.completions.create(model="tiny", prompt="hi", max_tokens=3, temperature=0)
        assert reply.usage.completion_tokens == 3

        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=120) == 0, log.read_text()
        with pytest.raises(httpx.TransportError):
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
        deadline = time.monotonic() + 30
        while any(Path(f"/proc/{pid}").exists() for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(Path(f"/proc/{pid}").exists() for pid in pids), "replica processes outlived the run"
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_what_cannot_start_says_why_and_stops_ray(artifact, tmp_path, monkeypatch):
    """More replicas than a local instance has CPUs, or a replica that cannot load the artifact (a file changed
    after compiling): an LlmlowerError saying why, and the local Ray is gone. (Before the module's replicas.)"""
    assert not ray.is_initialized(), "this test starts a Ray instance of its own"
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    with pytest.raises(LlmlowerError, match=r"1 replicas x 4096 threads need 4096 CPUs; this machine has \d+"):
        run_replicas(artifact, ENGINE, ServerConfig(MODEL), replicas=1, threads=4096, port=free_port(), blocking=False)
    assert not ray.is_initialized()

    changed = tmp_path / "changed"
    shutil.copytree(artifact, changed)
    with open(changed / "tokenizer.json", "a") as file:
        file.write(" ")
    with pytest.raises(LlmlowerError, match=r"tokenizer.json: sha256 does not match"):
        run_replicas(changed, ENGINE, ServerConfig(MODEL), replicas=1, threads=1, port=free_port(), blocking=False)
    assert not ray.is_initialized()


def test_a_full_deployment_answers_429_through_rays_proxy(artifact, monkeypatch):
    """One replica holding one sequence and one waiting (max_num_seqs 1, --max-waiting 1), and Ray's router queueing
    at most one more: of 8 long requests sent at once, those beyond get 429 with Retry-After at once instead of
    waiting without limit in front of the replica, and the others are served. (Before the module's replicas.)"""
    assert not ray.is_initialized(), "this test starts a Ray instance of its own"
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    engine = EngineConfig(max_num_seqs=1, max_context=128)
    config = ServerConfig(MODEL, KEY, max_waiting=1)

    async def eight_at_once(url: str) -> list[httpx.Response]:
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 100, "ignore_eos": True}
        headers = {"Authorization": f"Bearer {KEY}"}
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            return await asyncio.gather(*(http.post("/v1/completions", json=body, headers=headers) for _ in range(8)))

    with run_replicas(artifact, engine, config, replicas=1, threads=1, port=free_port(), blocking=False) as running:
        responses = asyncio.run(eight_at_once(running.url))
    statuses = sorted(r.status_code for r in responses)
    assert set(statuses) == {200, 429}, statuses
    assert all(r.headers.get("retry-after") for r in responses if r.status_code == 429)
    assert not ray.is_initialized()


def _metrics_by_replica(url: str, replicas: int = 2, tries: int = 60) -> dict[str, dict[str, float]]:
    """/metrics of each replica: asked until every replica has answered once (each answer is one replica's)."""
    seen: dict[str, dict[str, float]] = {}
    with httpx.Client(base_url=url, timeout=30) as http:
        for _ in range(tries):
            response = http.get("/metrics")
            samples = text_string_to_metric_families(response.text)
            seen[response.headers[REPLICA_HEADER]] = {s.name: s.value for f in samples for s in f.samples}
            if len(seen) == replicas:
                break
    return seen


def test_two_replicas_answer_what_one_engine_answers(url, expected):
    """8 questions, each asked whole and as a stream (with usage), all 16 at once through Ray's proxy: every text
    is the in-process engine's; the answers came from both replicas, whose /metrics add up to the tokens made.
    Both replicas answer /metrics first: right after start-up Ray's router may not yet know the second one."""
    assert len(_metrics_by_replica(url)) == 2, "Ray's proxy reached one replica only"

    async def ask_all() -> list[tuple[str, str, object]]:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)
        messages = [[{"role": "user", "content": q}] for q in QUESTIONS]

        async def whole(conversation) -> tuple[str, str, object]:
            raw = await client.chat.completions.with_raw_response.create(
                model=MODEL, messages=conversation, max_tokens=MAX_TOKENS, temperature=0
            )
            reply = raw.parse()
            return reply.choices[0].message.content, raw.headers[REPLICA_HEADER], reply.usage

        async def streamed(conversation) -> tuple[str, str, object]:
            raw = await client.chat.completions.with_raw_response.create(
                model=MODEL,
                messages=conversation,
                max_tokens=MAX_TOKENS,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
            parts, usage = [], None
            async for chunk in raw.parse():
                if chunk.choices:
                    parts.append(chunk.choices[0].delta.content or "")
                else:
                    usage = chunk.usage
            return "".join(parts), raw.headers[REPLICA_HEADER], usage

        try:
            return await asyncio.gather(*(whole(m) for m in messages), *(streamed(m) for m in messages))
        finally:
            await client.close()

    answers = asyncio.run(ask_all())
    assert [text for text, _, _ in answers] == expected + expected
    assert all(usage is not None and usage.completion_tokens > 0 for _, _, usage in answers)
    served = {replica for _, replica, _ in answers}
    assert len(served) == 2, f"one replica served all 16 requests: {served}"

    per_replica = _metrics_by_replica(url)
    assert set(per_replica) == served
    generated = sum(values["llmlower:generation_tokens_total"] for values in per_replica.values())
    assert generated == sum(usage.completion_tokens for _, _, usage in answers)
    assert all(values["llmlower:generation_tokens_total"] > 0 for values in per_replica.values())


def test_errors_keep_the_openai_envelope_through_the_proxy(url):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], temperature=-1)
    assert raised.value.body["param"] == "temperature" and raised.value.body["code"] == "invalid_value"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-9", prompt="hi")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()

    response = httpx.post(
        f"{url}/v1/chat/completions",
        content=b'{"model": "tiny", "messages": [',
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
    )
    assert response.status_code == 400 and response.headers[REPLICA_HEADER]
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == "invalid_json"

    health = httpx.get(f"{url}/health")
    assert health.status_code == 200 and json.loads(health.text) == {"status": "ok"}
    assert httpx.get(f"{url}/-/healthz").status_code == 200  # Ray's proxy itself
    reply = client.completions.create(model=MODEL, prompt="hi", max_tokens=2, temperature=0)
    assert reply.choices[0].finish_reason == "length"


def test_a_killed_replica_is_replaced_while_the_other_serves(url, expected):
    """The replica that answered is killed (its actor, as a crash would take it): every request after that is
    answered, with the in-process engine's text, by the other replica until Serve has started a new one, which
    then serves too. (Last of the module's replica tests: it changes the replicas.)"""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)

    def ask() -> tuple[str, str]:
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": QUESTIONS[0]}], max_tokens=MAX_TOKENS, temperature=0
        )
        return raw.parse().choices[0].message.content, raw.headers[REPLICA_HEADER]

    _, victim = ask()
    actor = next(a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].endswith(f"#{victim}"))
    ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]), no_restart=True)
    answered_by: list[str] = []
    deadline = time.monotonic() + 120
    while len(set(answered_by)) < 2 and time.monotonic() < deadline:
        text, replica = ask()
        assert text == expected[0]
        answered_by.append(replica)
    assert victim not in answered_by
    assert len(set(answered_by)) == 2, f"no new replica served within 120 s: {answered_by[-5:]}"


def test_replicas_need_an_artifact(tmp_path):
    with pytest.raises(LlmlowerError, match="compiled artifacts only"):
        run_replicas(tmp_path, ENGINE, ServerConfig(MODEL), replicas=2, blocking=False)
