"""Faults stay with their request: an executor that raises on a chosen step fails the requests of that step alone
(the engine, then the real server with the openai client: an error event then [DONE] for a stream, a 500 without
internals otherwise), a request whose tokens cannot be chosen fails without its step's other requests, the next
requests are served as they are alone, and nothing leaks (blocks, slots, the admission queue). An engine thread
that dies turns /health to 503, fails its callers and stops the server with an error. The faults are injected
into the real components (the tiny Llama on the torch reference executor)."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
import uvicorn

from llmlower.api import load_engine
from llmlower.errors import LlmlowerError, RequestFailed
from llmlower.runtime import Engine, SamplingParams
from llmlower.serve import ServerConfig, run, serving_app
from llmlower.serve.server import DrainingServer
from tests.ports import free_port

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPTS = ["The quick brown fox", "def add(a, b):", "keys and values"]
MODEL = "tiny"


class FailingExecutor:
    """The engine's real executor, raising on its `fail_at`-th step (counted from 1); the rest passes through."""

    def __init__(self, executor, fail_at: int) -> None:
        self.executor, self.fail_at, self.steps = executor, fail_at, 0

    def __getattr__(self, name: str):
        return getattr(self.executor, name)

    def step(self, batch):
        self.steps += 1
        if self.steps == self.fail_at:
            raise RuntimeError("injected executor fault: secret internals")
        return self.executor.step(batch)


@pytest.fixture()
def engine(tiny_llama) -> Engine:
    return load_engine(tiny_llama, max_context=128, max_num_seqs=4)


@pytest.fixture(scope="module")
def alone(tiny_llama) -> dict[str, list[int]]:
    engine = load_engine(tiny_llama, max_context=128)
    return {prompt: engine.generate([prompt], GREEDY, chat=False)[0].token_ids for prompt in PROMPTS}


def _assert_nothing_held(engine: Engine) -> None:
    stats = engine.stats()
    assert (stats.running, stats.waiting, stats.kv_blocks_used) == (0, 0, 0) and not engine.requests


def test_an_executor_fault_fails_the_requests_of_its_step_alone(engine, alone, caplog):
    """One sequence at a time: the first request's second step raises; it ends with an error delta, the waiting
    requests are then served exactly, and the traceback is in the log, not in the delta."""
    engine = Engine(FailingExecutor(engine.executor, fail_at=2), engine.tokenizer, engine.spec, config=engine.config)
    engine.scheduler.max_num_seqs = 1
    ids = [engine.add_request(prompt, GREEDY, chat=False) for prompt in PROMPTS]
    deltas = []
    while engine.has_unfinished():
        deltas += engine.step()
    errors = [d for d in deltas if d.error is not None]
    assert [(d.request_id, d.finish_reason) for d in errors] == [(ids[0], "error")]
    assert "running the model step" in errors[0].error and "secret" not in errors[0].error
    assert "injected executor fault" in caplog.text
    served = {d.request_id: d.result.token_ids for d in deltas if d.result is not None}
    assert served == {ids[1]: alone[PROMPTS[1]], ids[2]: alone[PROMPTS[2]]}
    assert engine.stats().finished["error"] == 1
    _assert_nothing_held(engine)
    assert [r.token_ids for r in engine.generate(PROMPTS, GREEDY, chat=False)] == [alone[p] for p in PROMPTS]


def test_a_request_whose_tokens_cannot_be_chosen_fails_without_its_step(engine, alone, monkeypatch):
    """The sampler fails for one request's rows (seed 13 here): its step's other requests get their tokens."""
    sample = engine.sampler.sample

    def failing(logits, states, *rest):
        if any(state.params.seed == 13 for state in states):
            raise ValueError("injected sampler fault")
        return sample(logits, states, *rest)

    monkeypatch.setattr(engine.sampler, "sample", failing)
    doomed = SamplingParams(temperature=0.7, seed=13, max_tokens=6)
    with pytest.raises(RequestFailed, match="choosing its tokens"):
        engine.generate(PROMPTS, [GREEDY, doomed, GREEDY], chat=False)
    _assert_nothing_held(engine)
    ids = [
        engine.add_request(p, params, chat=False) for p, params in zip(PROMPTS, [GREEDY, doomed, GREEDY], strict=True)
    ]
    deltas = []
    while engine.has_unfinished():
        deltas += engine.step()
    assert [d.request_id for d in deltas if d.error is not None] == [ids[1]]
    served = {d.request_id: d.result.token_ids for d in deltas if d.result is not None}
    assert served == {ids[0]: alone[PROMPTS[0]], ids[2]: alone[PROMPTS[2]]}
    _assert_nothing_held(engine)


@contextlib.contextmanager
def _live(engine: Engine, server_class: type[uvicorn.Server] = DrainingServer) -> Iterator[str]:
    """The app on a real uvicorn server on 127.0.0.1, in a thread of this process, until the block ends."""
    app = serving_app(engine, ServerConfig(MODEL, max_waiting=4))
    config = uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning")
    server = server_class(config, app) if server_class is DrainingServer else server_class(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.started
    try:
        yield f"http://127.0.0.1:{config.port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)


def _completion(url: str, prompt: str) -> str:
    reply = _client(url).completions.create(
        model=MODEL, prompt=prompt, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    return reply.choices[0].text


def test_an_executor_fault_reaches_streams_as_an_error_event_and_others_as_a_500(engine):
    executor = FailingExecutor(engine.executor, fail_at=0)  # no fault yet
    engine.core.executor = executor  # the engine core runs the steps
    with _live(engine) as url:
        alone = [_completion(url, prompt) for prompt in PROMPTS]
        executor.fail_at, executor.steps = 3, 0
        body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60) as response:
            assert response.status_code == 200
            events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == "engine_error" and "secret" not in error["message"]
        executor.fail_at, executor.steps = 2, 0
        with pytest.raises(openai.InternalServerError) as raised:
            _client(url).completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=6, temperature=0)
        assert raised.value.body["code"] == "engine_error" and "secret" not in raised.value.body["message"]
        assert [_completion(url, prompt) for prompt in PROMPTS] == alone
        for _ in range(8):  # the failed requests hold no admission slot: more than max_waiting requests pass
            _client(url).completions.create(model=MODEL, prompt="hi", max_tokens=1)
        assert httpx.get(f"{url}/health").json() == {"status": "ok"}
        _assert_nothing_held(engine)


def test_a_dead_engine_thread_fails_its_callers_and_health_turns_503(engine, monkeypatch):
    """(A plain uvicorn server here, so that it keeps answering after the engine thread died.)"""
    broken = threading.Event()
    stats = engine.stats

    def failing_stats():
        if broken.is_set():
            raise RuntimeError("injected bookkeeping fault")
        return stats()

    monkeypatch.setattr(engine, "stats", failing_stats)
    with _live(engine, uvicorn.Server) as url:
        assert httpx.get(f"{url}/health").status_code == 200
        broken.set()
        with pytest.raises(openai.InternalServerError) as raised:
            _client(url).completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4)
        assert raised.value.body["code"] == "engine_error" and "injected" not in raised.value.body["message"]
        health = httpx.get(f"{url}/health")
        assert (health.status_code, health.json()) == (503, {"status": "engine stopped"})
        with pytest.raises(openai.InternalServerError):  # and every later request
            _client(url).completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=4)


def test_run_raises_when_the_engine_thread_dies(engine, monkeypatch):
    """`llmlower serve` then exits non-zero (the CLI prints run's error): a supervisor or Ray restarts it."""
    monkeypatch.setattr(engine, "has_unfinished", lambda: (_ for _ in ()).throw(RuntimeError("injected")))
    port = free_port()
    outcome: list[BaseException] = []

    def serve() -> None:
        try:
            run(engine, ServerConfig(MODEL), port=port)
        except BaseException as error:
            outcome.append(error)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.TransportError):
            reply = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"model": MODEL, "prompt": "hi"})
            assert reply.status_code == 500
            break
        time.sleep(0.1)
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], LlmlowerError)
    assert "the engine thread stopped" in str(outcome[0])
