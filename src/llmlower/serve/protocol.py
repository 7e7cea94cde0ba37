"""OpenAI's completions and chat-completions requests and responses, and what they mean for the engine.

Requests are validated strictly (a string where a number belongs is an error, not a guess). The sampling fields
are OpenAI's plus vLLM's extras (top_k, min_p, repetition_penalty, stop_token_ids, ignore_eos, min_tokens,
include_stop_str_in_output), with OpenAI's defaults (temperature 1, completions stop after 16 tokens, chat
completions at the end of the context). Structured output comes as OpenAI's response_format (text, json_object,
json_schema) or vLLM's structured_outputs (json, json_object, regex, grammar). Fields of features this server does
not have (tools, suffix, echo, best_of) are refused rather than ignored.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..errors import GenerationError
from ..runtime import GenerationDelta, GenerationResult, SamplingParams, Tokenizer, TokenLogprob
from ..runtime.structured import StructuredOutput
from .errors import APIError

COMPLETIONS_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)
    include_usage: bool = False


class JsonSchema(BaseModel):
    """response_format's json_schema (OpenAI): the schema is always enforced, whatever `strict` says."""

    model_config = ConfigDict(strict=True, extra="ignore")
    name: str
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None


class StructuredOutputs(BaseModel):
    """vLLM's structured_outputs: one of a JSON schema, any JSON object, a regex or a Lark grammar."""

    model_config = ConfigDict(strict=True, extra="forbid")
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    json_object: bool = False
    regex: str | None = None
    grammar: str | None = None


class SamplingFields(BaseModel):
    """The fields both endpoints share."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputs | None = None
    response_format: ResponseFormat | None = None
    # features this server does not have: refused when set
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None

    def unsupported(self) -> list[str]:
        names = ["tools", "tool_choice", "functions", "function_call"]
        return [name for name in names if getattr(self, name) is not None]


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def unsupported(self) -> list[str]:
        extra = ["echo"] * self.echo + ["suffix"] * (self.suffix is not None)
        return super().unsupported() + extra + ["best_of"] * (self.best_of not in (None, self.n))


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def for_template(self) -> dict[str, str]:
        """The message as chat templates take it: text content, and `developer` as the system role it replaces."""
        text = "".join(part.text for part in self.content) if isinstance(self.content, list) else self.content
        return {"role": "system" if self.role == "developer" else self.role, "content": text or ""}


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0)
    max_completion_tokens: int | None = None


# ---------------------------------------------------------------- requests -> engine


def sampling_params(request: CompletionRequest | ChatRequest, max_tokens: int) -> SamplingParams:
    """The engine's SamplingParams for a request (max_tokens: the endpoint's default); a bad value is a 400
    naming its field."""
    unsupported = request.unsupported()
    if unsupported:
        raise APIError(400, f"{unsupported[0]} is not supported by this server", unsupported[0], "unsupported")
    if isinstance(request, ChatRequest):
        logprobs, top = request.logprobs, request.top_logprobs or 0
        if top and not logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs", "invalid_value")
        limit = request.max_completion_tokens or request.max_tokens
    else:
        logprobs, top = request.logprobs is not None, request.logprobs or 0
        limit = request.max_tokens
    fields = {
        "n": request.n,
        "temperature": 1.0 if request.temperature is None else request.temperature,
        "top_p": 1.0 if request.top_p is None else request.top_p,
        "top_k": request.top_k or 0,
        "min_p": request.min_p or 0.0,
        "repetition_penalty": request.repetition_penalty or 1.0,
        "presence_penalty": request.presence_penalty,
        "frequency_penalty": request.frequency_penalty,
        "logit_bias": _logit_bias(request.logit_bias),
        "seed": request.seed,
        "max_tokens": max_tokens if limit is None else limit,
        "min_tokens": request.min_tokens,
        "stop": request.stop or (),
        "stop_token_ids": request.stop_token_ids or (),
        "ignore_eos": request.ignore_eos,
        "logprobs": logprobs,
        "top_logprobs": top,
        "include_stop_str_in_output": request.include_stop_str_in_output,
        "structured_output": structured_output(request),
    }
    try:
        return SamplingParams(**fields)
    except GenerationError as error:
        param = error.field if error.field in fields else None
        if param == "max_tokens" and isinstance(request, ChatRequest) and request.max_completion_tokens is not None:
            param = "max_completion_tokens"
        raise APIError(400, str(error), param, "invalid_value") from None


def _structured(request: SamplingFields) -> tuple[dict[str, Any], str] | None:
    """The StructuredOutput fields a request asks for, and the request field they come from (errors name it)."""
    given = request.response_format
    if given is not None and given.type != "text" and request.structured_outputs is not None:
        message = "response_format and structured_outputs cannot both be set"
        raise APIError(400, message, "structured_outputs", "invalid_value")
    if given is not None and given.type == "json_schema":
        if given.json_schema is None:
            message = "response_format.json_schema is required when type is json_schema"
            raise APIError(400, message, "response_format.json_schema", "invalid_value")
        return {"json": given.json_schema.schema_}, "response_format.json_schema.schema"
    if given is not None and given.type == "json_object":
        return {"json_object": True}, "response_format"
    if request.structured_outputs is not None:
        fields = request.structured_outputs.model_dump(by_alias=True, exclude_defaults=True)
        return fields, "structured_outputs" + "".join(f".{name}" for name in fields if len(fields) == 1)
    return None


def grammar_source(request: SamplingFields) -> tuple[str, Any] | None:
    """(the request's field, its schema, regex or grammar) when it asks for structured output with one."""
    asked = _structured(request)
    if asked is None or asked[0] == {"json_object": True}:
        return None
    given, name = asked
    return name, next(iter(given.values())) if len(given) == 1 else given


def top_logprobs(request: CompletionRequest | ChatRequest) -> int:
    """Alternatives per token a request asks for: chat's top_logprobs, completions' logprobs."""
    return (request.top_logprobs if isinstance(request, ChatRequest) else request.logprobs) or 0


def structured_output(request: SamplingFields) -> StructuredOutput | None:
    """The request's response_format or structured_outputs as the engine's StructuredOutput; a bad one is a 400
    naming the request's field (response_format.json_schema.schema, structured_outputs.regex, ...)."""
    asked = _structured(request)
    if asked is None:
        return None
    try:
        return StructuredOutput(**asked[0])
    except GenerationError as error:  # a bad field, or no llguidance installed
        raise structured_error(error, request) or APIError(400, str(error), asked[1], "unsupported") from None


def structured_error(error: GenerationError, request: SamplingFields) -> APIError | None:
    """An engine error about a request's structured output (its field structured_output or structured_output.json,
    which its message starts with) as a 400 naming the request's own field; None for any other error."""
    asked = _structured(request)
    if asked is None or not (error.field or "").startswith("structured_output"):
        return None
    return APIError(400, asked[1] + str(error)[len(error.field) :], asked[1], "invalid_value")


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    try:
        return {int(token): value for token, value in (bias or {}).items()}
    except ValueError:
        raise APIError(400, "logit_bias keys must be token ids", "logit_bias", "invalid_value") from None


def completion_prompts(request: CompletionRequest) -> list[str | list[int]]:
    """The prompts of a completions request: one text, texts, token ids, or lists of token ids."""
    prompt = request.prompt
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    if not prompt:
        raise APIError(400, "prompt is empty", "prompt", "invalid_value")
    empty = next((i for i, p in enumerate(prompt) if len(p) == 0), None)
    if empty is not None:  # an empty prompt would be taken for an empty chat
        raise APIError(400, f"prompt.{empty} is empty", f"prompt.{empty}", "invalid_value")
    return list(prompt)


# ---------------------------------------------------------------- engine -> responses


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(results: list[GenerationResult]) -> dict[str, Any]:
    """Token counts of a request: each prompt counted once, every completion's tokens."""
    prompts = {r.request: r.usage.prompt_tokens for r in results}
    cached = {r.request: r.usage.cached_tokens for r in results}
    completion = sum(r.usage.completion_tokens for r in results)
    return {
        "prompt_tokens": sum(prompts.values()),
        "completion_tokens": completion,
        "total_tokens": sum(prompts.values()) + completion,
        "prompt_tokens_details": {"cached_tokens": sum(cached.values())},
    }


class Formatter:
    """Builds one request's response objects (whole, or chunk by chunk) in its endpoint's format."""

    def __init__(self, tokenizer: Tokenizer, model: str, chat: bool, n: int) -> None:
        self.tokenizer, self.model, self.chat, self.n = tokenizer, model, chat, n
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())

    def _token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def index(self, request: int, completion: int) -> int:
        """A choice's index: completions of the first prompt first (OpenAI's order)."""
        return request * self.n + completion

    def logprobs(self, entries: list[TokenLogprob], offset: int = 0) -> dict | None:
        """The chosen tokens' logprobs in the endpoint's format (chat: content entries; completions: parallel
        lists with text offsets)."""
        if self.chat:
            content = []
            for entry in entries:
                token = self._token(entry.token_id)
                top = [
                    {"token": (t := self._token(i)), "logprob": lp, "bytes": list(t.encode())} for i, lp in entry.top
                ]
                content.append(
                    {"token": token, "logprob": entry.logprob, "bytes": list(token.encode()), "top_logprobs": top}
                )
            return {"content": content}
        tokens = [self._token(e.token_id) for e in entries]
        offsets, position = [], offset
        for token in tokens:
            offsets.append(position)
            position += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{self._token(i): lp for i, lp in e.top} for e in entries],
            "text_offset": offsets,
        }

    def response(self, results: list[GenerationResult]) -> dict[str, Any]:
        """The whole response of a request that asked for no stream."""
        choices = []
        for result in sorted(results, key=lambda r: (r.request, r.index)):
            logprobs = self.logprobs(result.logprobs) if result.logprobs is not None else None
            choice: dict[str, Any] = {"index": self.index(result.request, result.index)}
            if self.chat:
                choice["message"] = {"role": "assistant", "content": result.text}
            else:
                choice["text"] = result.text
            choices.append({**choice, "logprobs": logprobs, "finish_reason": result.finish_reason})
        kind = "chat.completion" if self.chat else "text_completion"
        body = {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}
        return {**body, "usage": usage(results)}

    def chunk(self, choices: list[dict[str, Any]], usage_: dict | None = None, with_usage: bool = False) -> dict:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        body = {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}
        return {**body, "usage": usage_} if with_usage else body

    def role_choice(self, index: int) -> dict[str, Any]:
        """A chat stream's first chunk of a choice: the assistant role, no text yet."""
        return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}

    def delta_choice(self, delta: GenerationDelta, offset: int) -> dict[str, Any]:
        """A stream chunk's choice for one engine delta."""
        logprobs = self.logprobs([delta.logprob], offset) if delta.logprob is not None else None
        index = self.index(delta.request, delta.index)
        body = {"delta": {"content": delta.text}} if self.chat else {"text": delta.text}
        return {"index": index, **body, "logprobs": logprobs, "finish_reason": delta.finish_reason}
