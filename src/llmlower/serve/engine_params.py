"""What a completions or chat-completions request means for the engine: its SamplingParams (with the structured
output it asks for) and its prompts; a bad value is a 400 naming the request's own field."""

from __future__ import annotations

from typing import Any

from ..errors import GenerationError
from ..runtime import SamplingParams
from ..runtime.structured import StructuredOutput
from .errors import APIError
from .schemas import ChatRequest, CompletionRequest, SamplingFields
from .tools import ChatPrompt

COMPLETIONS_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


def sampling_params(
    request: CompletionRequest | ChatRequest, max_tokens: int, chat: ChatPrompt | None = None
) -> SamplingParams:
    """The engine's SamplingParams for a request (max_tokens: the endpoint's default; `chat`: a chat's prompt,
    whose tools bring their grammar); a bad value is a 400 naming its field."""
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
        "skip_special_tokens": request.skip_special_tokens and not (chat is not None and chat.keep_special),
        "structured_output": chat.structured_output() if chat and chat.grammar else structured_output(request),
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
    if not (error.field or "").startswith("structured_output"):
        return None
    name = asked[1] if asked is not None else "tools" if getattr(request, "tools", None) else None
    return None if name is None else APIError(400, name + str(error)[len(error.field) :], name, "invalid_value")


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    """logit_bias with JSON's string keys as token ids."""
    try:
        return {int(token): value for token, value in (bias or {}).items()}
    except ValueError:
        raise APIError(400, "logit_bias keys must be token ids", "logit_bias", "invalid_value") from None


def completion_prompts(
    prompt: str | list[str] | list[int] | list[list[int]], field: str = "prompt"
) -> list[str | list[int]]:
    """The prompts of a completions request (or the inputs of an embeddings request, `field` input): one text,
    texts, token ids, or lists of token ids."""
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    if not prompt:
        raise APIError(400, f"{field} is empty", field, "invalid_value")
    empty = next((i for i, p in enumerate(prompt) if len(p) == 0), None)
    if empty is not None:  # an empty prompt would be taken for an empty chat
        raise APIError(400, f"{field}.{empty} is empty", f"{field}.{empty}", "invalid_value")
    return list(prompt)
