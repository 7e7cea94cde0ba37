"""The engine's results as OpenAI's responses: whole completions and chat completions, their stream chunks
(server-sent events), logprobs, usage, and replies split into content and tool calls."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from ..runtime import GenerationDelta, GenerationResult, Tokenizer, TokenLogprob
from ..runtime.tool_calls import ToolCallParser, ToolFormat


def new_id(prefix: str) -> str:
    """A response id unique to this request (`cmpl-...`, `chatcmpl-...`)."""
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
    """Builds one request's response objects (whole, or chunk by chunk) in its endpoint's format; chat replies
    are parsed for calls in `tool_format` where the request offered tools."""

    def __init__(self, tokenizer: Tokenizer, model: str, chat: bool, n: int, tool_format: ToolFormat | None = None):
        self.tokenizer, self.model, self.chat, self.n = tokenizer, model, chat, n
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())
        self.tool_format = tool_format
        self._replies: dict[int, ReplyParser] = {}  # choice -> its reply so far (a stream with tools)

    def _token(self, token_id: int) -> str:
        """One token's text, special tokens included."""
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
            finish_reason = result.finish_reason
            if self.tool_format is not None:
                choice["message"], finish_reason = ReplyParser(self.tool_format).message(result.text, finish_reason)
            elif self.chat:
                choice["message"] = {"role": "assistant", "content": result.text}
            else:
                choice["text"] = result.text
            choices.append({**choice, "logprobs": logprobs, "finish_reason": finish_reason})
        kind = "chat.completion" if self.chat else "text_completion"
        body = {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}
        return {**body, "usage": usage(results)}

    def chunk(self, choices: list[dict[str, Any]], usage_: dict | None = None, with_usage: bool = False) -> dict:
        """A stream chunk of these choices (with a usage field, null until the last chunk, when asked for)."""
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
        finish_reason = delta.finish_reason
        if self.tool_format is not None:
            reply = self._replies.setdefault(index, ReplyParser(self.tool_format))
            message, finish_reason = reply.delta(delta.text, finish_reason)
            body: dict[str, Any] = {"delta": message}
        else:
            body = {"delta": {"content": delta.text}} if self.chat else {"text": delta.text}
        return {"index": index, **body, "logprobs": logprobs, "finish_reason": finish_reason}


class ReplyParser:
    """One choice's reply split into content and tool calls: as stream deltas, or whole."""

    def __init__(self, format: ToolFormat) -> None:
        self.parser = ToolCallParser(format)
        self.ids: list[str] = []  # the calls announced so far
        self.sent: list[int] = []  # characters of each call's arguments sent

    def delta(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """A stream chunk's delta for the reply's next text, and its finish_reason ("tool_calls" where it ended
        with calls)."""
        content = self.parser.feed(text) + (self.parser.finish() if finish_reason is not None else "")
        calls = []
        for index, call in enumerate(self.parser.calls):
            if call.name is None:
                continue
            entry: dict[str, Any] = {"index": index}
            if index == len(self.ids):
                self.ids.append(new_id("call"))
                self.sent.append(0)
                entry |= {"id": self.ids[index], "type": "function", "function": {"name": call.name, "arguments": ""}}
            fresh = call.arguments[self.sent[index] :]
            self.sent[index] = len(call.arguments)
            if fresh:
                entry.setdefault("function", {})["arguments"] = fresh
            if len(entry) > 1:
                calls.append(entry)
        delta: dict[str, Any] = {"content": content} if content or not calls else {}
        return ({**delta, "tool_calls": calls} if calls else delta), self._finish_reason(finish_reason)

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The whole reply as an assistant message (content, tool_calls), and its finish_reason."""
        content = self.parser.feed(text) + self.parser.finish()
        calls = [
            {"id": new_id("call"), "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
            for call in self.parser.complete_calls
        ]
        message: dict[str, Any] = {"role": "assistant", "content": content or (None if calls else "")}
        return ({**message, "tool_calls": calls} if calls else message), self._finish_reason(finish_reason)

    def _finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if reason == "stop" and self.parser.complete_calls else reason


def sse(payload: dict[str, Any]) -> str:
    """One server-sent event carrying a JSON payload."""
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
