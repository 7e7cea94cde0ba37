"""OpenAI's completions and chat-completions requests as pydantic models (runtime parameters from them:
engine_params.py; responses: responses.py).

Requests are validated strictly (a string where a number belongs is an error, not a guess). The sampling fields
are OpenAI's plus vLLM's extras (top_k, min_p, repetition_penalty, stop_token_ids, ignore_eos, min_tokens,
include_stop_str_in_output), with OpenAI's defaults (temperature 1, completions stop after 16 tokens, chat
completions at the end of the context). Structured output comes as OpenAI's response_format (text, json_object,
json_schema) or vLLM's structured_outputs (json, json_object, regex, grammar). Fields of features this server does
not have (tools, suffix, echo, best_of) are refused rather than ignored.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class StreamOptions(BaseModel):
    """stream_options: whether a stream ends with a usage chunk."""

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
    """OpenAI's response_format: text (no constraint), any JSON object, or JSON of a schema."""

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
        """The fields set that this server does not support (a request with one is refused)."""
        names = ["tools", "tool_choice", "functions", "function_call"]
        return [name for name in names if getattr(self, name) is not None]


class CompletionRequest(SamplingFields):
    """A /v1/completions request: prompts as text or token ids; `logprobs` is the alternatives per token."""

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def unsupported(self) -> list[str]:
        extra = ["echo"] * self.echo + ["suffix"] * (self.suffix is not None)
        return super().unsupported() + extra + ["best_of"] * (self.best_of not in (None, self.n))


class TextPart(BaseModel):
    """A text part of a message's content (the only kind this server takes)."""

    model_config = ConfigDict(strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One message of a conversation."""

    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def for_template(self) -> dict[str, str]:
        """The message as chat templates take it: text content, and `developer` as the system role it replaces."""
        text = "".join(part.text for part in self.content) if isinstance(self.content, list) else self.content
        return {"role": "system" if self.role == "developer" else self.role, "content": text or ""}


class ChatRequest(SamplingFields):
    """A /v1/chat/completions request: a conversation, rendered by the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0)
    max_completion_tokens: int | None = None
