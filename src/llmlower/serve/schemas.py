"""OpenAI's completions and chat-completions requests as pydantic models (runtime parameters from them:
engine_params.py; responses: responses.py).

Requests are validated strictly (a string where a number belongs is an error, not a guess). The sampling fields
are OpenAI's plus vLLM's extras (top_k, min_p, repetition_penalty, stop_token_ids, ignore_eos, min_tokens,
include_stop_str_in_output), with OpenAI's defaults (temperature 1, completions stop after 16 tokens, chat
completions at the end of the context). Structured output comes as OpenAI's response_format (text, json_object,
json_schema) or vLLM's structured_outputs (json, json_object, regex, grammar). Chats take OpenAI's tools, tool_choice
and parallel_tool_calls, and history with tool calls and results. Fields of features this server does not have
(functions, suffix, echo, best_of) are refused rather than ignored.
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
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputs | None = None
    response_format: ResponseFormat | None = None
    # features this server does not have (or not on this endpoint): refused when set
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


class FunctionCall(BaseModel):
    """A past call's function: its name and its arguments as JSON text (OpenAI's shape)."""

    model_config = ConfigDict(strict=True, extra="ignore")
    name: str
    arguments: str


class MessageToolCall(BaseModel):
    """A tool call an assistant message made."""

    model_config = ConfigDict(strict=True, extra="ignore")
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    """One message of a conversation: an assistant's may carry tool_calls, a tool's answers one by tool_call_id."""

    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None

    @property
    def text(self) -> str:
        """The content as one text."""
        return "".join(part.text for part in self.content) if isinstance(self.content, list) else self.content or ""


class FunctionDefinition(BaseModel):
    """A function the model may call: its name, what it does, and its arguments' JSON schema."""

    model_config = ConfigDict(strict=True, extra="ignore")
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    """One of a request's tools (OpenAI has functions only)."""

    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    name: str


class NamedToolChoice(BaseModel):
    """tool_choice naming the one function to call."""

    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["function"]
    function: FunctionName


class ChatRequest(SamplingFields):
    """A /v1/chat/completions request: a conversation, rendered by the model's chat template, with the tools the
    model may call; chat_template_kwargs are further variables for the template (enable_thinking, ...);
    include_reasoning false drops the reasoning from the reply."""

    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0)
    max_completion_tokens: int | None = None
    tools: list[Tool] | None = None  # type: ignore[assignment]
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # type: ignore[assignment]
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    include_reasoning: bool = True  # vLLM's: reasoning_content in the reply (where the template has markers)

    def unsupported(self) -> list[str]:
        return [name for name in ("functions", "function_call") if getattr(self, name) is not None]


class TokenizeRequest(BaseModel):
    """A /tokenize request: a prompt (add_special_tokens as for completions) or a chat (with its tools and template
    variables, rendered with the generation prompt as for chat completions)."""

    model_config = ConfigDict(strict=True, extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    tools: list[Tool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    """A /detokenize request: token ids to text."""

    model_config = ConfigDict(strict=True, extra="forbid")
    model: str | None = None
    tokens: list[int]


class LoadLoraRequest(BaseModel):
    """A /v1/load_lora_adapter request: a PEFT adapter directory on the server's machine, and its name in the API."""

    model_config = ConfigDict(strict=True, extra="forbid")
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1)


class UnloadLoraRequest(BaseModel):
    """A /v1/unload_lora_adapter request."""

    model_config = ConfigDict(strict=True, extra="forbid")
    lora_name: str = Field(min_length=1)


class EmbeddingRequest(BaseModel):
    """A /v1/embeddings request: texts or token ids; `dimensions` keeps the leading ones (renormalized), as models
    trained for it (Matryoshka) allow; base64 is little-endian float32."""

    model_config = ConfigDict(strict=True, extra="ignore")
    model: str
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None
