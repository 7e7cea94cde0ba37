"""`llmlower serve` tested live on 127.0.0.1 with the real `openai` client (pinned in the dev extra) and httpx: a
tiny Llama ONNX artifact served by a subprocess, as a user would start it."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import math
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

KEY = "test-key"
MODEL = "tiny"
ARTIFACT = "long-llama-onnx"  # also the model name a server started without --served-model-name gives
QUESTIONS = [f"Question {i}: what comes after {i} and {i + 1}?" for i in range(64)]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def artifact(prebuilt) -> Path:
    """A tiny Llama with 1,024 positions: long enough that a request outlives its client's disconnect."""
    return prebuilt(ARTIFACT)


@pytest.fixture(scope="module")
def server(artifact, tmp_path_factory, serving) -> Iterator[str]:
    log = tmp_path_factory.mktemp("serve-log") / "server.log"
    flags = ("--api-key", KEY, "--served-model-name", MODEL, "--max-num-seqs", "16", "--max-body-bytes", "64K")
    flags += ("--max-n", "20", "--max-grammar-bytes", "4096")
    with serving(artifact, *flags, log=log) as (url, _):
        yield url


def _client(url: str, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)


def _metrics(url: str) -> dict[str, float]:
    """Every sample of /metrics by name (the model label dropped: one model), finish reasons as `name{reason}`."""
    text = httpx.get(f"{url}/metrics").text
    samples = (s for family in text_string_to_metric_families(text) for s in family.samples)
    return {
        s.name + (f"{{{s.labels['finished_reason']}}}" if "finished_reason" in s.labels else ""): s.value
        for s in samples
    }


def _wait_idle(url: str, timeout: float = 30) -> dict[str, float]:
    """/metrics once nothing runs or waits and no KV block is used."""
    deadline = time.monotonic() + timeout
    while True:
        values = _metrics(url)
        idle = values["llmlower:num_requests_running"] == values["llmlower:num_requests_waiting"] == 0
        if idle and values["llmlower:kv_cache_usage_perc"] == 0 or time.monotonic() > deadline:
            return values
        time.sleep(0.1)


def _one_by_one(url: str, questions: list[str], max_tokens: int = 12) -> list[str]:
    client = _client(url)
    texts = []
    for question in questions:
        reply = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": question}], max_tokens=max_tokens, temperature=0
        )
        texts.append(reply.choices[0].message.content)
    return texts


def test_64_concurrent_streams_get_what_each_gets_alone(server):
    """64 streaming chat requests at once (16 run, 48 wait): every stream's text, token by token, is the text
    the same request gets alone; usage comes last when asked for."""
    expected = _one_by_one(server, QUESTIONS)

    async def stream_all() -> list[tuple[str, dict]]:
        client = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=300)

        async def one(question: str) -> tuple[str, dict]:
            stream = await client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": question}],
                max_tokens=12,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
            parts, usage = [], None
            async for chunk in stream:
                if chunk.choices:
                    parts.append(chunk.choices[0].delta.content or "")
                else:
                    usage = chunk.usage
            return "".join(parts), usage

        return await asyncio.gather(*(one(q) for q in QUESTIONS))

    streamed = asyncio.run(stream_all())
    assert [text for text, _ in streamed] == expected
    assert all(usage.completion_tokens == 12 for _, usage in streamed)
    _wait_idle(server)


def test_completions_and_chat_in_their_own_formats(server):
    client = _client(server)
    completion = client.completions.create(
        model=MODEL, prompt=["The quick brown fox", "def add(a, b):"], max_tokens=6, temperature=0, n=2, logprobs=3
    )
    assert [c.index for c in completion.choices] == [0, 1, 2, 3]
    assert completion.choices[0].text == completion.choices[1].text  # greedy: both completions agree
    logprobs = completion.choices[2].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 6
    assert "".join(logprobs.tokens) == completion.choices[2].text and logprobs.text_offset[0] == 0
    assert all(len(top) <= 3 for top in logprobs.top_logprobs)
    assert completion.usage.completion_tokens == 24 and completion.usage.prompt_tokens > 0

    seeded = {
        "model": MODEL,
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}],
        "max_completion_tokens": 5,
        "temperature": 0.9,
        "seed": 7,
        "extra_body": {"top_k": 40, "min_p": 0.05, "repetition_penalty": 1.1, "ignore_eos": True},
    }
    chat = client.chat.completions.create(**seeded, logprobs=True, top_logprobs=2)
    again = client.chat.completions.create(**seeded)
    assert chat.choices[0].message.content == again.choices[0].message.content  # seeded: reproducible
    entries = chat.choices[0].logprobs.content
    assert len(entries) == 5 and all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in entries)
    assert chat.choices[0].finish_reason == "length"

    stop = completion.choices[0].text[2:4]
    stopped = client.completions.create(
        model=MODEL, prompt="The quick brown fox", max_tokens=6, temperature=0, stop=[stop]
    )
    assert stopped.choices[0].finish_reason == "stop" and stop not in stopped.choices[0].text
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_clients_that_disconnect_mid_stream_free_their_blocks(server):
    """20 streaming clients that leave after two chunks, and 5 non-streaming ones (n = 8) that give up: their 60
    completions are aborted (counted as such, far fewer tokens generated than asked for), KV usage goes back to 0,
    the next requests are right."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "tell me"}],
        "max_tokens": 900,
        "ignore_eos": True,
        "stream": True,
    }
    headers = {"Authorization": f"Bearer {KEY}"}
    before = _wait_idle(server)
    with httpx.Client(base_url=server, headers=headers, timeout=60) as http:
        for _ in range(20):
            with http.stream("POST", "/v1/chat/completions", json=body) as response:
                lines = response.iter_lines()
                assert next(lines).startswith("data: ")
                next(lines)  # then the client closes the connection mid-stream
    for _ in range(5):
        with contextlib.suppress(httpx.TimeoutException):
            httpx.post(
                f"{server}/v1/chat/completions", json={**body, "stream": False, "n": 8}, headers=headers, timeout=0.05
            )
    values = _wait_idle(server)
    assert values["llmlower:kv_cache_usage_perc"] == 0 and values["llmlower:num_requests_running"] == 0
    aborted = values["llmlower:request_success_total{abort}"] - before["llmlower:request_success_total{abort}"]
    assert aborted == 20 + 5 * 8
    assert values["llmlower:generation_tokens_total"] - before["llmlower:generation_tokens_total"] < 60 * 900 / 4
    assert _one_by_one(server, QUESTIONS[:3]) == _one_by_one(server, QUESTIONS[:3])


BAD_REQUESTS = [  # (what, path, body or raw bytes, headers, status, param, code)
    ("malformed JSON", "/v1/chat/completions", b'{"model": "tiny", "messages": [', {}, 400, None, "invalid_json"),
    ("not an object", "/v1/completions", b"[1, 2]", {}, 400, None, "invalid_value"),
    ("temperature as text", "/v1/chat/completions", {"temperature": "hot"}, {}, 400, "temperature", "invalid_value"),
    ("max_tokens as text", "/v1/completions", {"max_tokens": "10"}, {}, 400, "max_tokens", "invalid_value"),
    ("no messages", "/v1/chat/completions", {"messages": None}, {}, 400, "messages", "invalid_value"),
    ("empty messages", "/v1/chat/completions", {"messages": []}, {}, 400, "messages", "invalid_value"),
    (
        "unknown role",
        "/v1/chat/completions",
        {"messages": [{"role": "robot", "content": "x"}]},
        {},
        400,
        "messages.0.role",
        "invalid_value",
    ),
    ("negative temperature", "/v1/chat/completions", {"temperature": -1.0}, {}, 400, "temperature", "invalid_value"),
    ("top_p 0", "/v1/completions", {"top_p": 0.0}, {}, 400, "top_p", "invalid_value"),
    ("n 0", "/v1/completions", {"n": 0}, {}, 400, "n", "invalid_value"),
    ("n above max_num_seqs", "/v1/completions", {"n": 17}, {}, 400, "n", "invalid_value"),
    ("an empty prompt among prompts", "/v1/completions", {"prompt": ["hi", ""]}, {}, 400, "prompt.1", "invalid_value"),
    ("an empty list of token ids", "/v1/completions", {"prompt": [[]]}, {}, 400, "prompt.0", "invalid_value"),
    # the server's limits (--max-n 20, --max-grammar-bytes 4096, the other limits at their defaults)
    ("n above --max-n", "/v1/completions", {"n": 21}, {}, 400, "n", "too_large"),
    ("logprobs 30", "/v1/completions", {"logprobs": 30}, {}, 400, "logprobs", "too_large"),
    (
        "top_logprobs 21",
        "/v1/chat/completions",
        {"logprobs": True, "top_logprobs": 21},
        {},
        400,
        "top_logprobs",
        "too_large",
    ),
    ("17 stop strings", "/v1/completions", {"stop": [f"s{i}" for i in range(17)]}, {}, 400, "stop", "too_large"),
    ("a stop string of 257 characters", "/v1/completions", {"stop": "x" * 257}, {}, 400, "stop", "too_large"),
    (
        "257 stop_token_ids",
        "/v1/completions",
        {"stop_token_ids": [5] * 257},
        {},
        400,
        "stop_token_ids",
        "too_large",
    ),
    (
        "301 logit_bias entries",
        "/v1/completions",
        {"logit_bias": {str(i): 1.0 for i in range(301)}},
        {},
        400,
        "logit_bias",
        "too_large",
    ),
    (
        "a regex over --max-grammar-bytes",
        "/v1/completions",
        {"structured_outputs": {"regex": "a" * 4097}},
        {},
        400,
        "structured_outputs.regex",
        "too_large",
    ),
    (
        "a JSON schema over --max-grammar-bytes",
        "/v1/chat/completions",
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"enum": ["y" * 4096]}}}},
        {},
        400,
        "response_format.json_schema.schema",
        "too_large",
    ),
    (
        "top_logprobs without logprobs",
        "/v1/chat/completions",
        {"top_logprobs": 2},
        {},
        400,
        "top_logprobs",
        "invalid_value",
    ),
    (
        "logit_bias key not a token",
        "/v1/completions",
        {"logit_bias": {"abc": 1.0}},
        {},
        400,
        "logit_bias",
        "invalid_value",
    ),
    (
        "logit_bias beyond the vocabulary",
        "/v1/completions",
        {"logit_bias": {"99999": 1.0}},
        {},
        400,
        "logit_bias",
        "invalid_value",
    ),
    (
        "stop token beyond the vocabulary",
        "/v1/chat/completions",
        {"stop_token_ids": [99999]},
        {},
        400,
        "stop_token_ids",
        "invalid_value",
    ),
    ("prompt ids beyond the vocabulary", "/v1/completions", {"prompt": [1, 99999]}, {}, 400, "prompt", "invalid_value"),
    (
        "prompt beyond the context",
        "/v1/completions",
        {"prompt": "fox " * 1100},
        {},
        400,
        "prompt",
        "context_length_exceeded",
    ),
    (
        "max_tokens beyond the context",
        "/v1/chat/completions",
        {"max_tokens": 1100},
        {},
        400,
        "messages",
        "context_length_exceeded",
    ),
    (
        "a tool without its function",
        "/v1/chat/completions",
        {"tools": [{"type": "function"}]},
        {},
        400,
        "tools.0.function",
        "invalid_value",
    ),
    (
        "functions (deprecated)",
        "/v1/chat/completions",
        {"functions": [{"name": "f"}]},
        {},
        400,
        "functions",
        "unsupported",
    ),
    ("tools on completions", "/v1/completions", {"tools": [{"type": "function"}]}, {}, 400, "tools", "unsupported"),
    (
        "JSON schema llguidance refuses",
        "/v1/chat/completions",
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
        {},
        400,
        "response_format.json_schema.schema",
        "invalid_value",
    ),
    (
        "json_schema without a schema",
        "/v1/chat/completions",
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        {},
        400,
        "response_format.json_schema.schema",
        "invalid_value",
    ),
    (
        "response_format xml",
        "/v1/completions",
        {"response_format": {"type": "xml"}},
        {},
        400,
        "response_format.type",
        "invalid_value",
    ),
    (
        "bad regex",
        "/v1/completions",
        {"structured_outputs": {"regex": "(abc"}},
        {},
        400,
        "structured_outputs.regex",
        "invalid_value",
    ),
    (
        "bad Lark grammar",
        "/v1/chat/completions",
        {"structured_outputs": {"grammar": "start: missing"}},
        {},
        400,
        "structured_outputs.grammar",
        "invalid_value",
    ),
    (
        "a special token the tokenizer lacks",
        "/v1/completions",
        {"structured_outputs": {"grammar": 'start: "x" <|nope|>'}},
        {},
        400,
        "structured_outputs.grammar",
        "invalid_value",
    ),
    (
        "two structured outputs",
        "/v1/completions",
        {"structured_outputs": {"regex": "a", "json_object": True}},
        {},
        400,
        "structured_outputs",
        "invalid_value",
    ),
    (
        "response_format and structured_outputs",
        "/v1/chat/completions",
        {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
        {},
        400,
        "structured_outputs",
        "invalid_value",
    ),
    (
        "structured_outputs choice",
        "/v1/completions",
        {"structured_outputs": {"choice": ["a", "b"]}},
        {},
        400,
        "structured_outputs.choice",
        "invalid_value",
    ),
    ("unknown model", "/v1/completions", {"model": "gpt-9"}, {}, 404, "model", "model_not_found"),
    ("no API key", "/v1/models", None, {"Authorization": ""}, 401, None, "invalid_api_key"),
    ("wrong API key", "/v1/completions", {}, {"Authorization": "Bearer nope"}, 401, None, "invalid_api_key"),
    ("body over the limit", "/v1/completions", {"prompt": "x" * 70_000}, {}, 413, None, "request_too_large"),
    ("unknown path", "/v1/audio/speech", {}, {}, 404, None, None),
]


INNOCENT = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 64, "temperature": 0}


@pytest.fixture(scope="module")
def innocent_alone(server) -> str:
    """What the innocent request gets when it is alone on the server."""
    return _client(server).completions.create(**INNOCENT, extra_body={"ignore_eos": True}).choices[0].text


@contextlib.contextmanager
def _innocent_running(server: str, alone: str) -> Iterator[None]:
    """The innocent request streams (its first token is out) while the block runs; then its text must be the one
    it gets alone."""
    stream = _client(server).completions.create(**INNOCENT, stream=True, extra_body={"ignore_eos": True})
    parts = [next(iter(stream)).choices[0].text]
    yield
    parts += [chunk.choices[0].text for chunk in stream]
    assert "".join(parts) == alone


@pytest.mark.parametrize("case", BAD_REQUESTS, ids=[case[0] for case in BAD_REQUESTS])
def test_bad_requests_get_an_openai_error_beside_an_innocent_request(server, innocent_alone, case):
    what, path, body, headers, status, param, code = case
    base = {"model": MODEL}
    base.update({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"})
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json", **headers}
    with _innocent_running(server, innocent_alone):
        if body is None:
            response = httpx.get(f"{server}{path}", headers=headers)
        else:
            content = body if isinstance(body, bytes) else json.dumps({**base, **body}).encode()
            response = httpx.post(f"{server}{path}", content=content, headers=headers)
    assert response.status_code == status, (what, response.text)
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], what
    assert (error["param"], error["code"]) == (param, code), (what, error)
    assert httpx.get(f"{server}/health").status_code == 200


def test_requests_at_every_limit_are_served_beside_an_innocent_request(server, innocent_alone):
    """Requests right at the server's limits (n = 16, all of --max-num-seqs; 16 stop strings of 256 characters,
    256 stop token ids, 300 logit_bias entries, 20 top logprobs, a 4,096-byte grammar), all at once: each is served,
    and the innocent request streaming beside them gets its answer alone."""
    client = _client(server)
    at_limits = [
        {"prompt": "one", "n": 16},
        {"prompt": "two", "stop": [f"{i:03d}" + "x" * 253 for i in range(16)]},
        {"prompt": "three", "extra_body": {"stop_token_ids": list(range(64, 320))}},
        {"prompt": "four", "logit_bias": {str(i): -1.0 for i in range(300)}},
        {"prompt": "five", "logprobs": 20},
        {"prompt": "six", "extra_body": {"structured_outputs": {"regex": "(a|b)" * 819 + "a"}}},
    ]
    with _innocent_running(server, innocent_alone), concurrent.futures.ThreadPoolExecutor(len(at_limits)) as pool:
        replies = [pool.submit(client.completions.create, model=MODEL, max_tokens=8, **r) for r in at_limits]
        answers = [reply.result() for reply in replies]
    assert [len(answer.choices) for answer in answers] == [16, 1, 1, 1, 1, 1]
    assert all(choice.finish_reason in ("length", "stop") for answer in answers for choice in answer.choices)


def test_hostile_sampling_values_are_served_beside_an_innocent_request(server):
    """top_k = 2**63 (the vocabulary) and a subnormal temperature (greedy) in the same steps as an innocent request:
    each is answered, and the innocent request gets its answer alone."""
    client = _client(server)
    innocent = {**INNOCENT, "max_tokens": 8}
    alone = client.completions.create(**innocent).choices[0].text
    hostile = [
        {"prompt": "def add(a, b):", "max_tokens": 8, "extra_body": {"top_k": 2**63}, "seed": 1},
        {"prompt": "keys and values", "max_tokens": 8, "temperature": 5e-324, "logprobs": 2},
    ]
    with concurrent.futures.ThreadPoolExecutor(len(hostile) + 1) as pool:
        replies = [pool.submit(client.completions.create, **{"model": MODEL, **h}) for h in hostile]
        beside = pool.submit(client.completions.create, **innocent)
        assert beside.result().choices[0].text == alone
        answers = [reply.result().choices[0] for reply in replies]
    assert all(answer.finish_reason == "length" for answer in answers)
    assert all(math.isfinite(lp) for lp in answers[1].logprobs.token_logprobs)


def test_the_openai_client_sees_typed_errors(server):
    with pytest.raises(openai.AuthenticationError):
        _client(server, key="wrong").models.list()
    with pytest.raises(openai.NotFoundError):
        _client(server).completions.create(model="other", prompt="hi")
    with pytest.raises(openai.BadRequestError) as raised:
        _client(server).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], top_p=2.0)
    assert raised.value.body["param"] == "top_p"


def test_structured_output_with_response_format_and_structured_outputs(server):
    """A JSON schema as OpenAI's response_format (whole and streamed), a regex as vLLM's structured_outputs; a
    schema llguidance refuses is the openai client's BadRequestError naming the param."""
    client = _client(server)
    person = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    asked = {"model": MODEL, "messages": [{"role": "user", "content": "A person"}], "max_tokens": 200, "temperature": 0}
    reply = client.chat.completions.create(**asked, response_format=person)
    jsonschema.validate(json.loads(reply.choices[0].message.content), PERSON)
    assert reply.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(**asked, response_format=person, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == reply.choices[0].message.content
    regex = r"[0-9]{3}-[a-z]{2,4}"
    code = client.completions.create(
        model=MODEL, prompt="Code:", max_tokens=30, temperature=0, extra_body={"structured_outputs": {"regex": regex}}
    )
    assert re.fullmatch(regex, code.choices[0].text) and code.choices[0].finish_reason == "stop"
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(
            **asked, response_format={**person, "json_schema": {"name": "x", "schema": {"type": "foo"}}}
        )
    assert raised.value.body["param"] == "response_format.json_schema.schema"
    assert "not a valid JSON schema" in raised.value.body["message"]


def test_metrics_parse_and_move_with_the_traffic(server):
    before = _wait_idle(server)
    client = _client(server)
    client.completions.create(model=MODEL, prompt="counting tokens", max_tokens=5, temperature=0, n=2)
    after = _wait_idle(server)
    moved = {name: after[name] - before[name] for name in before}
    assert moved["llmlower:generation_tokens_total"] == 10
    assert moved["llmlower:prompt_tokens_total"] > 0 and moved["llmlower:prefix_cache_queries_total"] > 0
    assert moved["llmlower:time_to_first_token_seconds_count"] == 2  # one per completion
    assert moved["llmlower:e2e_request_latency_seconds_count"] == 2
    assert moved["llmlower:request_queue_time_seconds_count"] == 2
    assert moved["llmlower:inter_token_latency_seconds_count"] == 8  # 4 gaps per completion
    assert moved["llmlower:request_success_total{length}"] == 2 and moved["llmlower:request_success_total{abort}"] == 0
    assert "llmlower:num_preemptions_total" in after
    assert httpx.get(f"{server}/metrics").status_code == 200  # no API key needed


def test_requests_past_the_deadline_are_aborted_beside_an_innocent_one(artifact, tmp_path, serving):
    """--request-timeout 0.3: a 1,000-token request (whole or streamed; 1,000 steps take seconds) ends at its
    deadline, 408 or an error event then [DONE], and frees its blocks, also when its client stops reading and keeps
    the connection open; a short request beside it gets its answer alone."""
    with serving(artifact, "--request-timeout", "0.3", log=tmp_path / "log") as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
        innocent = {"model": ARTIFACT, "prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0}
        alone = client.completions.create(**innocent).choices[0].text
        endless = {"model": ARTIFACT, "prompt": "Once upon a time", "max_tokens": 1000}
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            streamed = pool.submit(_streamed_events, url, {**endless, "ignore_eos": True})
            with pytest.raises(openai.APIStatusError) as raised:
                client.completions.create(**endless, extra_body={"ignore_eos": True})
            assert client.completions.create(**innocent).choices[0].text == alone
            events = streamed.result()
        assert raised.value.status_code == 408 and raised.value.body["code"] == "request_timeout"
        assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "request_timeout"
        values = _wait_idle(url)
        assert values["llmlower:kv_cache_usage_perc"] == 0 and values["llmlower:num_requests_running"] == 0
        body = {**endless, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as silent:  # not read until idle
            values = _wait_idle(url)
            assert values["llmlower:kv_cache_usage_perc"] == 0 and values["llmlower:num_requests_running"] == 0
            events = [line.removeprefix("data: ") for line in silent.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "request_timeout"


def test_an_n_2_request_beside_three_prompts_on_four_sequences(artifact, tmp_path, serving):
    """ONNX Runtime on the CPU keeps each sequence in a KV slot of its own: an n = 2 request beside three short
    prompts with --max-num-seqs 4 holds its fork's slot from admission, so all are answered and each short prompt
    gets its answer alone."""
    with serving(artifact, "--max-num-seqs", "4", log=tmp_path / "log") as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
        shorts = [{"model": ARTIFACT, "prompt": p, "max_tokens": 8, "temperature": 0} for p in ("a", "b c", "d e f")]
        alone = [client.completions.create(**short).choices[0].text for short in shorts]
        pair = {"model": ARTIFACT, "prompt": "Once upon a time", "max_tokens": 24, "n": 2, "temperature": 0}
        for _ in range(3):
            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                pairs = pool.submit(client.completions.create, **pair, extra_body={"ignore_eos": True})
                beside = [pool.submit(client.completions.create, **short) for short in shorts]
                assert [reply.result().choices[0].text for reply in beside] == alone
                assert [choice.finish_reason for choice in pairs.result().choices] == ["length", "length"]


def _streamed_events(url: str, body: dict) -> list[str]:
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60) as response:
        return [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]


def test_speculative_serving_counts_proposals_and_keeps_structured_output_and_tool_calls(artifact, tmp_path, serving):
    flags = ("--speculative", "ngram", "--num-speculative-tokens", "3")
    with serving(artifact, *flags, log=tmp_path / "log") as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
        repeated = "compile the graph, compile the graph, compile the graph, compile the"
        client.completions.create(model=ARTIFACT, prompt=repeated, max_tokens=24, temperature=0)
        reply = client.chat.completions.create(
            model=ARTIFACT,
            messages=[{"role": "user", "content": "a person as JSON"}],
            max_tokens=80,
            temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
        )
        jsonschema.validate(json.loads(reply.choices[0].message.content), PERSON)
        tool = {"type": "function", "function": {"name": "person", "parameters": PERSON}}
        called = client.chat.completions.create(
            model=ARTIFACT,
            messages=[{"role": "user", "content": "a person, compile the graph, compile the graph"}],
            max_tokens=120,
            temperature=0,
            tools=[tool],
            tool_choice="required",
            parallel_tool_calls=False,
        )
        (call,) = called.choices[0].message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), PERSON)
        values = _wait_idle(url)
    drafts, proposed = (
        values["llmlower:spec_decode_num_drafts_total"],
        values["llmlower:spec_decode_num_draft_tokens_total"],
    )
    assert proposed >= drafts >= 1 and proposed >= values["llmlower:spec_decode_num_accepted_tokens_total"]
    assert "llmlower:spec_decode_num_accepted_tokens_per_pos_total" in values


def test_a_full_queue_answers_429_with_retry_after(artifact, tmp_path, serving):
    flags = ("--max-num-seqs", "1", "--max-num-batched-tokens", "8", "--max-waiting", "1")
    with serving(artifact, *flags, log=tmp_path / "log") as (url, _):
        body = {"model": ARTIFACT, "prompt": "a long one", "max_tokens": 100, "ignore_eos": True}

        async def flood() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=url, timeout=120) as http:
                return await asyncio.gather(*(http.post("/v1/completions", json=body) for _ in range(6)))

        responses = asyncio.run(flood())
        refused = [r for r in responses if r.status_code == 429]
        assert refused and all(r.headers["Retry-After"] == "1" for r in refused)
        assert refused[0].json()["error"]["code"] == "queue_full"
        assert any(r.status_code == 200 for r in responses)


def test_sigterm_lets_running_requests_finish_then_exits(artifact, tmp_path, serving):
    with serving(artifact, "--max-context", "128", log=tmp_path / "log") as (url, process):
        body = {"model": ARTIFACT, "prompt": "go on", "max_tokens": 100, "ignore_eos": True, "stream": True}
        chunks = []
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    chunks.append(line)
                if len(chunks) == 3:
                    process.send_signal(signal.SIGTERM)  # mid-stream
                if len(chunks) == 6:  # draining: a new request is turned away
                    try:
                        refused = httpx.post(f"{url}/v1/completions", json=body | {"stream": False}, timeout=5)
                        assert refused.status_code == 503 and refused.headers["Retry-After"]
                    except httpx.TransportError:
                        pass  # the listening socket is closed already
        assert chunks[-1] == "data: [DONE]"
        assert json.loads(chunks[-2][6:])["choices"][0]["finish_reason"] == "length"  # it ran to the end
        assert process.wait(timeout=60) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal once drained
        assert "Application shutdown complete" in (tmp_path / "log").read_text()
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{url}/health", timeout=2)
