"""Tool calls in a model's own format: found by rendering its chat template with and without a call, constrained
by a grammar once the model opens a call, and parsed (whole or as a stream) into names and JSON arguments.

A format is the text the template writes around calls: `head` up to the first function's name, `name_to_args`
between a name and its JSON arguments, `between` from one call's arguments to the next call's name, and `tail`
after the last arguments. A template that renders no calls (or not as a name and a JSON object) gets GENERIC: the
tools are described in a system message and calls are written as `<tool_call>{"name": ..., "arguments": ...}
</tool_call>`.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .markers import held_back

Message = dict[str, Any]

NAME, SECOND_NAME = "fn_probe_q", "fn_probe_z"
ARGUMENTS = {"arg_probe_q": "value_probe_q", "arg_probe_z": 7}
CONTENT = "content_probe_q"
TOOL_NAME_PATTERN = re.compile(r"[A-Za-z0-9_.-]{1,64}")


@dataclass(frozen=True)
class ToolFormat:
    """The text around tool calls (see the module's docstring); `between` is None where the template writes one
    call a turn; `trigger`: the marker in the head that opens calls. `native`: read from the model's template (else
    the generic format)."""

    head: str
    name_to_args: str
    between: str | None
    tail: str
    trigger: str
    key_separator: str = ": "
    item_separator: str = ", "
    native: bool = True

    @property
    def after_trigger(self) -> str:
        """The rest of the head after the trigger (forced once the trigger is written)."""
        return self.head[self.head.index(self.trigger) + len(self.trigger) :]

    def render(self, calls: Sequence[tuple[str, str]]) -> str:
        """The text of (name, JSON arguments) calls in this format (how the generic format writes past calls)."""
        joint = self.tail + self.head if self.between is None else self.between
        parts = [f"{name}{self.name_to_args}{arguments}" for name, arguments in calls]
        return f"{self.head}{joint.join(parts)}{self.tail}" if calls else ""


GENERIC = ToolFormat(
    head='<tool_call>\n{"name": "',
    name_to_args='", "arguments": ',
    between='}\n</tool_call>\n<tool_call>\n{"name": "',
    tail="}\n</tool_call>",
    trigger="<tool_call>",
    native=False,
)
GENERIC_INSTRUCTIONS = (
    "You may call one or more functions to answer. The functions, as JSON schemas:\n{tools}\n"
    'To call a function, write <tool_call>\n{{"name": <the function\'s name>, "arguments": <its arguments as a JSON '
    "object>}}\n</tool_call> for each call."
)


def _probe_call(name: str) -> dict[str, Any]:
    return {"id": f"call_{name}", "type": "function", "function": {"name": name, "arguments": ARGUMENTS}}


def _region(base: str, other: str) -> str:
    """The part of `other` that differs from `base` (their common prefix and suffix removed)."""
    start = 0
    while start < min(len(base), len(other)) and base[start] == other[start]:
        start += 1
    end = 0
    while end < min(len(base), len(other)) - start and base[-1 - end] == other[-1 - end]:
        end += 1
    return other[start : len(other) - end]


def _trigger(head: str, special_tokens: Collection[str]) -> str:
    """The marker that opens calls: a special token the head starts with (`[TOOL_CALLS]`), else the head up to
    its JSON (`<tool_call>`), else the whole head (a call that starts with its JSON: `{"name": "`)."""
    head = head.strip()
    special = [token for token in special_tokens if token and head.startswith(token)]
    if special:
        return max(special, key=len)
    return head.split("{", 1)[0].strip() or head


def find_format(render: Callable[[list[Message]], str], special_tokens: Collection[str] = ()) -> ToolFormat | None:
    """The tool-call format a chat template writes (`render`: messages -> text, without a generation prompt;
    `special_tokens`: the texts of the tokenizer's special tokens), or None where it writes no calls as a name and a
    JSON object."""
    user = {"role": "user", "content": "question_probe_q"}

    def turn(names: list[str]) -> str:
        calls = [_probe_call(name) for name in names]
        return render([user, {"role": "assistant", "content": "", "tool_calls": calls}])

    try:
        plain, one = render([user, {"role": "assistant", "content": CONTENT}]), turn([NAME])
    except Exception:  # a template that cannot render calls at all  # noqa: BLE001
        return None
    try:
        two = turn([NAME, SECOND_NAME])
    except Exception:  # one call a turn  # noqa: BLE001
        two = one
    region = _region(plain, one)
    start, key = region.find(NAME), region.find('"arg_probe_q"')
    opening = region.rfind("{", start, key)
    if start < 0 or key < 0 or opening < 0:
        return None
    try:
        arguments, end = json.JSONDecoder().raw_decode(region, opening)
    except json.JSONDecodeError:
        return None
    if arguments != ARGUMENTS:
        return None
    text = region[opening:end]
    head, name_to_args, tail = region[:start], region[start + len(NAME) : opening], region[end:]
    key_separator = text[len('{"arg_probe_q"') : text.index('"value_probe_q"')]
    item_separator = text[text.index('"value_probe_q"') + len('"value_probe_q"') : text.index('"arg_probe_z"')]
    both = _region(plain, two)
    second = both.find(SECOND_NAME, len(head) + len(NAME) + len(name_to_args) + len(text))
    between = both[len(region) - len(tail) : second] if second >= 0 else None
    expected = region[: len(region) - len(tail)] + f"{between}{SECOND_NAME}{name_to_args}{text}{tail}"
    if between is not None and both != expected:
        between = None
    trigger = _trigger(head, special_tokens)
    return ToolFormat(head, name_to_args, between, tail, trigger, key_separator, item_separator)


def generic_messages(messages: list[Message], tools: list[dict[str, Any]]) -> list[Message]:
    """A conversation with tools for a template that knows none: the tools described in the system message, past
    calls written into the assistant's text, tool results given as user messages."""
    described = "\n".join(json.dumps(tool.get("function", tool), ensure_ascii=False) for tool in tools)
    instructions = GENERIC_INSTRUCTIONS.format(tools=described)
    result: list[Message] = []
    for message in messages:
        role, content = message["role"], message.get("content") or ""
        if role == "assistant" and message.get("tool_calls"):
            functions = [call["function"] for call in message["tool_calls"]]
            calls = [(function["name"], _arguments_text(function["arguments"])) for function in functions]
            result.append({"role": "assistant", "content": content + GENERIC.render(calls)})
        elif role == "tool":
            result.append({"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"})
        else:
            result.append({"role": role, "content": content})
    if tools and result and result[0]["role"] == "system":
        result[0] = {"role": "system", "content": f"{result[0]['content']}\n\n{instructions}"}
    elif tools:
        result.insert(0, {"role": "system", "content": instructions})
    return result


def _arguments_text(arguments: Any) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def _literal(text: str, added_tokens: Mapping[str, int]) -> str:
    """`text` as Lark: string literals, and the tokens added to the vocabulary as token ids (llguidance matches
    such tokens only by id)."""
    if not text:
        return '""'
    markers = sorted((token for token in added_tokens if token and token in text), key=len, reverse=True)
    if not markers:
        return json.dumps(text, ensure_ascii=False)
    pieces = re.split("(" + "|".join(map(re.escape, markers)) + ")", text)
    return " ".join(
        f"<[{added_tokens[piece]}]>" if piece in added_tokens else json.dumps(piece, ensure_ascii=False)
        for piece in pieces
        if piece
    )


def tool_grammar(
    format: ToolFormat,
    functions: Sequence[tuple[str, dict[str, Any]]],
    required: bool,
    parallel: bool,
    added_tokens: Mapping[str, int],
) -> str:
    """An llguidance Lark grammar for a reply with calls of `functions` ((name, JSON schema of the arguments)):
    free text until the trigger, then calls whose arguments match their schemas; `required`: calls from the first
    token. `added_tokens`: the vocabulary's added tokens by text (a trigger that is one ends free text by itself;
    a trigger of text ends it lazily, at its first appearance)."""
    literal = functools.partial(_literal, added_tokens=added_tokens)
    trigger = literal(format.trigger)
    lazy = "" if format.trigger in added_tokens else "[lazy]"
    separators = {"key_separator": format.key_separator, "item_separator": format.item_separator}
    lines = [
        "%llguidance {}",
        f"start: opener calls{'' if required else ' | TEXT'}",
        f"opener: {trigger}" if required else f"opener{lazy}: TEXT {trigger}",
        f"calls: {literal(format.after_trigger)} call"
        + (f" ({literal(format.between)} call)*" if parallel and format.between is not None else "")
        + f" {literal(format.tail)}",
        "call: " + " | ".join(f"fn_{index}" for index in range(len(functions))),
    ]
    for index, (name, schema) in enumerate(functions):
        schema = {**schema, "x-guidance": {**separators, "whitespace_flexible": False, **schema.get("x-guidance", {})}}
        lines.append(f"fn_{index}: {literal(name)} {literal(format.name_to_args)} args_{index}")
        lines.append(f"args_{index}: %json {json.dumps(schema, ensure_ascii=False)}")
    lines.append(r"TEXT: /(.|\n)*/")
    return "\n".join(lines) + "\n"


@dataclass
class ToolCall:
    """One call as parsed so far: its name once complete, its arguments' JSON text as it arrives."""

    name: str | None = None
    arguments: str = ""
    done: bool = False


@dataclass
class ToolCallParser:
    """Splits a reply, as its text arrives, into content and tool calls of one format. feed() returns the new
    content; `calls` holds the calls as parsed so far (a new name or new argument text appear there in place)."""

    format: ToolFormat
    calls: list[ToolCall] = field(default_factory=list)
    _buffer: str = ""
    _state: str = "text"  # text, head, name, arguments, after

    def feed(self, text: str) -> str:
        """Take the next text of the reply; returns what of it (and of text held back before) is content."""
        self._buffer += text
        content = ""
        if self._state == "text":
            trigger = self.format.trigger
            at = self._buffer.find(trigger)
            if at < 0:
                cut = len(self._buffer) - held_back(self._buffer, [trigger])
                content, self._buffer = self._buffer[:cut], self._buffer[cut:]
                return content
            content, self._buffer, self._state = self._buffer[:at], self._buffer[at + len(trigger) :], "head"
        self._advance()
        return content

    def _advance(self) -> None:
        """Parse as far as the buffer allows."""
        while True:
            if self._state == "head":
                if len(self._buffer) < len(self.format.after_trigger):
                    return
                self._buffer = self._buffer[len(self.format.after_trigger) :]
                self._state = "name"
                self.calls.append(ToolCall())
            elif self._state == "name":
                at = self._buffer.find(self.format.name_to_args)
                if at < 0:
                    return
                self.calls[-1].name = self._buffer[:at]
                self._buffer, self._state = self._buffer[at + len(self.format.name_to_args) :], "arguments"
            elif self._state == "arguments":
                end = json_object_end(self._buffer)
                call = self.calls[-1]
                if end is None:  # the arguments so far, kept in the buffer until they are complete
                    call.arguments = self._buffer
                    return
                call.arguments, self._buffer = self._buffer[:end], self._buffer[end:]
                call.done, self._state = True, "after"
            elif self._state == "after":
                between = self.format.between
                if between is not None and self._buffer.startswith(between):
                    self._buffer, self._state = self._buffer[len(between) :], "name"
                    self.calls.append(ToolCall())
                else:
                    return

    def finish(self) -> str:
        """The reply has ended: content still held back (an unfinished trigger, or text after the calls)."""
        if self._state == "text":
            held, self._buffer = self._buffer, ""
            return held
        return ""

    @property
    def complete_calls(self) -> list[ToolCall]:
        """The calls whose arguments are complete JSON."""
        return [call for call in self.calls if call.done and call.name is not None]


def json_object_end(text: str) -> int | None:
    """The end of the JSON object `text` starts with, or None while it is unfinished."""
    depth, in_string, escaped = 0, False, False
    for index, char in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
            if depth == 0:
                return index + 1
    return None
