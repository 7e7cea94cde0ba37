"""A chat request's tools: the conversation and template variables that present them to the model, the grammar that
keeps its calls valid (runtime/tool_calls.py), the format its replies are parsed in, and the reasoning markers
they are split at (responses.ReplyParser)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ..errors import GenerationError
from ..runtime import Tokenizer
from ..runtime.reasoning import ReasoningFormat
from ..runtime.structured import StructuredOutput
from ..runtime.tool_calls import TOOL_NAME_PATTERN, ToolFormat, generic_messages, tool_grammar
from .errors import APIError
from .schemas import ChatMessage, ChatRequest, NamedToolChoice

# template variables a request may not set through chat_template_kwargs (the server sets them)
RESERVED_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt"})
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}  # a function without parameters


@dataclass(frozen=True)
class ChatPrompt:
    """What a chat request gives the template (`messages`, `template_kwargs`) and, where it offers tools, the
    functions the model may call ((name, arguments' schema)), the grammar its reply follows and the format its
    replies are parsed in; `keep_special`: the format's markers hold special tokens, kept in the text. Replies are
    split into reasoning and content at the template's `reasoning` markers."""

    messages: list[dict[str, Any]]
    template_kwargs: dict[str, Any]
    functions: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    grammar: str | None = None
    format: ToolFormat | None = None
    keep_special: bool = False
    reasoning: ReasoningFormat | None = None  # the template's reasoning markers
    reasoning_inside: bool = False  # the generation prompt opens reasoning: the reply starts inside it
    include_reasoning: bool = True

    def structured_output(self) -> StructuredOutput | None:
        """The tool grammar, compiled and checked (slow for large schemas: call it off the event loop); a schema
        llguidance refuses is a 400 naming its tool."""
        if self.grammar is None:
            return None
        try:
            return StructuredOutput(grammar=self.grammar)
        except GenerationError as error:
            for index, (_, schema) in enumerate(self.functions):
                try:
                    StructuredOutput(json=schema)
                except GenerationError as bad:
                    param = f"tools[{index}].function.parameters"
                    message = f"{param}: {str(bad).split(': ', 1)[-1]}"
                    raise APIError(400, message, param, "invalid_value") from None
            raise APIError(400, f"tools: {error}", "tools", "invalid_value") from None


def _template_message(message: ChatMessage, index: int) -> dict[str, Any]:
    """A message as chat templates take it: text content, `developer` as the system role it replaces, past calls'
    arguments as objects (templates write them with tojson)."""
    role = "system" if message.role == "developer" else message.role
    result: dict[str, Any] = {"role": role, "content": message.text}
    if message.tool_calls:
        calls = []
        for number, call in enumerate(message.tool_calls):
            try:
                arguments = json.loads(call.function.arguments)
            except json.JSONDecodeError as exc:
                param = f"messages[{index}].tool_calls[{number}].function.arguments"
                raise APIError(400, f"{param}: not JSON ({exc})", param, "invalid_value") from None
            function = {"name": call.function.name, "arguments": arguments}
            calls.append({"id": call.id, "type": "function", "function": function})
        result["tool_calls"] = calls
    if message.role == "tool":
        result["tool_call_id"] = message.tool_call_id or ""
    if message.name is not None and message.role == "tool":
        result["name"] = message.name
    return result


def _offered(body: ChatRequest) -> list[tuple[str, dict[str, Any]]]:
    """The functions the model may call under the request's tool_choice, checked: names unique and as OpenAI
    allows, a named choice among them."""
    tools, choice = body.tools or [], body.tool_choice
    names = [tool.function.name for tool in tools]
    for index, name in enumerate(names):
        if not TOOL_NAME_PATTERN.fullmatch(name):
            param = f"tools[{index}].function.name"
            message = f"{param}: {name!r} is not a function name (1 to 64 of a-z, A-Z, 0-9, _, ., -)"
            raise APIError(400, message, param, "invalid_value")
        if name in names[:index]:
            param = f"tools[{index}].function.name"
            raise APIError(400, f"{param}: {name!r} is given twice", param, "invalid_value")
    if choice is not None and choice != "none" and not tools:
        raise APIError(400, "tool_choice needs tools", "tool_choice", "invalid_value")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        param = "tool_choice.function.name"
        raise APIError(400, f"{param}: no tool is named {choice.function.name!r}", param, "invalid_value")
    if choice == "none":
        return []
    if isinstance(choice, NamedToolChoice):
        tools = [tool for tool in tools if tool.function.name == choice.function.name]
    return [(tool.function.name, tool.function.parameters or NO_PARAMETERS) for tool in tools]


def chat_prompt(body: ChatRequest, tokenizer: Tokenizer) -> ChatPrompt:
    """The chat request's prompt and tool plan; a bad tool, tool_choice, past call or template variable is a 400
    naming its field."""
    functions = _offered(body)
    if functions and (body.response_format is not None and body.response_format.type != "text"):
        raise APIError(400, "response_format cannot be combined with tools", "response_format", "invalid_value")
    if functions and body.structured_outputs is not None:
        raise APIError(400, "structured_outputs cannot be combined with tools", "structured_outputs", "invalid_value")
    extra = dict(body.chat_template_kwargs or {})
    reserved = sorted((RESERVED_VARIABLES | set(tokenizer.special_tokens())) & set(extra))
    if reserved:
        param = f"chat_template_kwargs.{reserved[0]}"
        raise APIError(400, f"{param}: set by the server, not by a request", param, "invalid_value")
    messages = [_template_message(message, index) for index, message in enumerate(body.messages)]
    format = tokenizer.tool_format
    offered = [tool.model_dump(exclude_none=True) for tool in body.tools or []] if functions else []
    if not format.native:
        messages = generic_messages(messages, offered)
    elif offered:
        extra["tools"] = offered
    reasoning = tokenizer.reasoning_format
    variables = {name: extra[name] for name in body.chat_template_kwargs or {}}
    thinking = {
        "reasoning": reasoning,
        "reasoning_inside": reasoning is not None and reasoning.opened_by(_generation_prompt(tokenizer, variables)),
        "include_reasoning": body.include_reasoning,
    }
    markers = "" if reasoning is None else reasoning.start + reasoning.end
    if not functions:
        return ChatPrompt(messages, extra, keep_special=_special_in(tokenizer, markers), **thinking)
    named = isinstance(body.tool_choice, NamedToolChoice)
    required = body.tool_choice == "required" or named
    parallel = body.parallel_tool_calls and not named
    grammar = tool_grammar(format, functions, required, parallel, tokenizer.added_tokens())
    markers += format.head + (format.between or "") + format.tail
    return ChatPrompt(messages, extra, functions, grammar, format, _special_in(tokenizer, markers), **thinking)


def _generation_prompt(tokenizer: Tokenizer, variables: dict[str, Any]) -> str:
    """The template's generation prompt under the request's variables (a template that fails here fails later, on
    the whole conversation, with its own message)."""
    try:
        return tokenizer.generation_prompt(**variables)
    except GenerationError:
        return ""


def _special_in(tokenizer: Tokenizer, text: str) -> bool:
    """Whether `text` holds special tokens (decoding would drop them: the reply's text keeps them instead)."""
    return any(token in text for token in tokenizer.added_tokens(special_only=True))
