"""Tool calling, /tokenize and /detokenize through `llmlower serve` with the real openai client: a tiny Llama whose
chat template writes calls in <tool_call> tags (its own format, read from the template), and one whose template
knows no tools (the generic format). The models are random: valid calls come from the grammar alone."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import jsonschema
import openai
import pytest

KEY = "tools-key"
MODEL = "tiny"
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ADD = {
    "type": "object",
    "properties": {
        "a": {"type": "integer", "minimum": -99, "maximum": 99},
        "b": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["a", "b"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "parameters": ADD}},
    {"type": "function", "function": {"name": "now"}},  # no parameters: an empty object
]
SCHEMAS = {
    "get_weather": WEATHER,
    "add": ADD,
    "now": {"type": "object", "properties": {}, "additionalProperties": False},
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def server(prebuilt, tmp_path_factory, serving) -> Iterator[str]:
    """The tiny Llama with a template that presents tools and writes calls in <tool_call> tags."""
    log = tmp_path_factory.mktemp("tools-log") / "server.log"
    flags = ("--api-key", KEY, "--served-model-name", MODEL, "--max-tools", "4", "--max-grammar-bytes", "4096")
    with serving(prebuilt("tools-llama-onnx"), *flags, log=log) as (url, _):
        yield url


@pytest.fixture(scope="module")
def generic_server(prebuilt, tmp_path_factory, serving) -> Iterator[str]:
    """The tiny Llama whose ChatML template knows no tools."""
    log = tmp_path_factory.mktemp("generic-tools-log") / "server.log"
    with serving(prebuilt("long-llama-onnx"), "--api-key", KEY, "--served-model-name", MODEL, log=log) as (url, _):
        yield url


def _valid_calls(choice, names: frozenset[str] = frozenset(SCHEMAS)) -> list[tuple[str, dict]]:
    """A choice's calls as (name, arguments), each checked against its function's schema."""
    calls = [(call.function.name, json.loads(call.function.arguments)) for call in choice.message.tool_calls or []]
    for name, arguments in calls:
        assert name in names
        jsonschema.validate(arguments, SCHEMAS[name])
    assert all(call.id.startswith("call") and call.type == "function" for call in choice.message.tool_calls or [])
    return calls


def _tokens(url: str, text: str) -> list[int]:
    body = {"prompt": text, "add_special_tokens": False}
    reply = httpx.post(f"{url}/tokenize", json=body, headers={"Authorization": f"Bearer {KEY}"})
    return reply.json()["tokens"]


def test_each_tool_choice_gives_calls_that_validate(server):
    """required, a named function, auto (nudged to open a call by logit_bias on the <tool_call> token), auto left
    alone, and none; with parallel calls on and off; several completions of one request each parse on their own."""
    client = _client(server)
    ask = {"model": MODEL, "messages": ASK, "tools": TOOLS, "max_tokens": 600, "temperature": 1.0, "seed": 3}
    reply = client.chat.completions.create(**ask, tool_choice="required", n=3)
    for choice in reply.choices:
        assert _valid_calls(choice) and choice.finish_reason == "tool_calls" and choice.message.content is None
    named = {"type": "function", "function": {"name": "add"}}
    reply = client.chat.completions.create(**ask, tool_choice=named, n=2)
    for choice in reply.choices:
        assert [name for name, _ in _valid_calls(choice, frozenset({"add"}))] == ["add"]
    single = client.chat.completions.create(**ask, tool_choice="required", parallel_tool_calls=False, n=3)
    assert all(len(_valid_calls(choice)) == 1 for choice in single.choices)
    (opener,) = _tokens(server, "<tool_call>")
    nudged = client.chat.completions.create(**ask, tool_choice="auto", logit_bias={str(opener): 100})
    assert _valid_calls(nudged.choices[0]) and nudged.choices[0].finish_reason == "tool_calls"
    for choice in ("auto", "none"):
        reply = client.chat.completions.create(
            **{**ask, "max_tokens": 8}, tool_choice=choice, logit_bias={str(opener): -100}
        )
        assert reply.choices[0].message.tool_calls is None and isinstance(reply.choices[0].message.content, str)
        assert reply.choices[0].finish_reason in ("stop", "length")


def test_streamed_calls_add_up_to_the_whole_reply(server):
    """Greedy, streamed and not: the deltas of each call (its id, name and type first, then its arguments in
    pieces) add up to the whole reply's calls, and the last chunk says tool_calls."""
    client = _client(server)
    ask = {"model": MODEL, "messages": ASK, "tools": TOOLS, "tool_choice": "required", "temperature": 0}
    whole = client.chat.completions.create(**ask, max_tokens=200)
    calls: dict[int, dict] = {}
    reasons = []
    for chunk in client.chat.completions.create(**ask, max_tokens=200, stream=True):
        for choice in chunk.choices:
            reasons.append(choice.finish_reason)
            for delta in choice.delta.tool_calls or []:
                if delta.id is not None:
                    assert delta.index not in calls and delta.function.name and delta.type == "function"
                    calls[delta.index] = {"name": delta.function.name, "arguments": ""}
                calls[delta.index]["arguments"] += delta.function.arguments or ""
    expected = [(c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls]
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == expected
    assert reasons[-1] == "tool_calls" and set(reasons[:-1]) == {None}


def test_a_call_and_its_result_in_the_history_reach_the_template(server):
    """A past call and the tool's answer are rendered by the template (in its own tags) into the prompt."""
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "3"},
    ]
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"messages": history, "tools": TOOLS, "return_token_strs": True}
    rendered = "".join(httpx.post(f"{server}/tokenize", json=body, headers=headers).json()["token_strs"])
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>' in rendered
    assert "<tool_response>\n3\n</tool_response>" in rendered and '"name": "get_weather"' in rendered
    reply = _client(server).chat.completions.create(
        model=MODEL, messages=history, tools=TOOLS, tool_choice="required", max_tokens=200, temperature=0
    )
    assert _valid_calls(reply.choices[0])


def test_a_template_without_tools_gets_the_generic_format(generic_server):
    """ChatML knows no tools: they are described in a system message, and calls come back in <tool_call> tags,
    valid as with a template's own format; a past call is written into the assistant's text."""
    client = _client(generic_server)
    ask = {"model": MODEL, "messages": ASK, "tools": TOOLS, "max_tokens": 200, "seed": 1}
    reply = client.chat.completions.create(**ask, tool_choice="required", parallel_tool_calls=False, n=2)
    for choice in reply.choices:
        assert _valid_calls(choice) and choice.finish_reason == "tool_calls", (choice, reply.usage)
    headers = {"Authorization": f"Bearer {KEY}"}
    text = httpx.post(
        f"{generic_server}/tokenize", json={"messages": ASK, "tools": TOOLS, "return_token_strs": True}, headers=headers
    ).json()["token_strs"]
    assert "To call a function, write <tool_call>" in "".join(text)


def test_tokenize_and_detokenize_round_trip(server):
    headers = {"Authorization": f"Bearer {KEY}"}
    text = "The quick brown fox, 東京 🙂"
    tokens = httpx.post(f"{server}/tokenize", json={"prompt": text}, headers=headers).json()
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] > 0
    back = httpx.post(f"{server}/detokenize", json={"tokens": tokens["tokens"]}, headers=headers).json()
    assert back["prompt"].endswith(text)
    assert httpx.post(f"{server}/tokenize", json={"prompt": text}).status_code == 401
    bad = httpx.post(f"{server}/detokenize", json={"tokens": [10**6]}, headers=headers)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    generates = httpx.post(f"{server}/v1/embeddings", json={"model": MODEL, "input": "hi"}, headers=headers)
    assert generates.status_code == 400 and "--task embed" in generates.json()["error"]["message"]


BAD_TOOLS = [
    ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools[0].function.name"),
    ({"tools": [TOOLS[1], TOOLS[1]]}, "tools[1].function.name"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "foo"}}}]},
        "tools[0].function.parameters",
    ),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": TOOLS * 2}, "tools"),
    ({"tools": TOOLS, "chat_template_kwargs": {"messages": []}}, "chat_template_kwargs.messages"),
    (
        {
            "messages": [
                {
                    "role": "assistant",
                    "tool_calls": [{"id": "c", "type": "function", "function": {"name": "add", "arguments": "{oops"}}],
                }
            ]
        },
        "messages[0].tool_calls[0].function.arguments",
    ),
]


@pytest.mark.parametrize(("fields", "param"), BAD_TOOLS, ids=[param for _, param in BAD_TOOLS])
def test_bad_tools_are_refused_naming_the_field(server, fields, param):
    fields = dict(fields)
    with pytest.raises(openai.BadRequestError) as raised:
        extra = {name: fields.pop(name) for name in ("chat_template_kwargs",) if name in fields}
        _client(server).chat.completions.create(
            **{"model": MODEL, "messages": ASK, "max_tokens": 4, **fields}, extra_body=extra
        )
    assert raised.value.body["param"] == param
    assert _client(server).chat.completions.create(model=MODEL, messages=ASK, max_tokens=2).choices


def test_reasoning_comes_apart_from_the_answer(server):
    """The template thinks in <think> tags: a reply held by a grammar to think then answer comes back with
    reasoning_content and content apart (whole and streamed alike), without the reasoning when include_reasoning is
    false; enable_thinking false reaches the template (its generation prompt closes the block)."""
    client = _client(server)
    thought = {"grammar": 'start: "<think>" /[a-z]{2,8}( [a-z]{2,8}){1,3}/ "</think>" "\\n\\n" /[a-z]{2,8}/'}
    ask = {"model": MODEL, "messages": ASK, "max_tokens": 80, "temperature": 0}
    message = client.chat.completions.create(**ask, extra_body={"structured_outputs": thought}).choices[0].message
    reasoning = message.model_extra["reasoning_content"]
    assert " " in reasoning and "<think>" not in reasoning and message.content.isalpha()
    pieces = {"reasoning_content": "", "content": ""}
    for chunk in client.chat.completions.create(**ask, stream=True, extra_body={"structured_outputs": thought}):
        for field in pieces:
            pieces[field] += (chunk.choices[0].delta.model_extra or {}).get(field) or ""
        pieces["content"] += chunk.choices[0].delta.content or ""
    assert pieces == {"reasoning_content": reasoning, "content": message.content}
    dropped = (
        client.chat.completions.create(**ask, extra_body={"structured_outputs": thought, "include_reasoning": False})
        .choices[0]
        .message
    )
    assert "reasoning_content" not in (dropped.model_extra or {}) and dropped.content == message.content
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"messages": ASK, "chat_template_kwargs": {"enable_thinking": False}, "return_token_strs": True}
    rendered = "".join(httpx.post(f"{server}/tokenize", json=body, headers=headers).json()["token_strs"])
    assert rendered.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
