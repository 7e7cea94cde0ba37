"""The engine's results as OpenAI's responses: whole completions and chat completions, their stream chunks
(server-sent events), logprobs, usage, and chat replies split into reasoning, content and tool calls."""

from __future__ import annotations

import base64
import json
import time
import uuid
from typing import Any

import numpy as np

from ..runtime import GenerationDelta, GenerationResult, Tokenizer, TokenLogprob
from ..runtime.reasoning import ReasoningParser
from ..runtime.tool_calls import ToolCall, ToolCallParser
from .tools import ChatPrompt


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
    """Builds one request's response objects (whole, or chunk by chunk) in its endpoint's format; a chat's replies
    are split into reasoning, content and tool calls where its `prompt` has reasoning markers or offers tools."""

    def __init__(self, tokenizer: Tokenizer, model: str, n: int, prompt: ChatPrompt | None = None) -> None:
        self.tokenizer, self.model, self.chat, self.n = tokenizer, model, prompt is not None, n
        self.id = new_id("chatcmpl" if self.chat else "cmpl")
        self.created = int(time.time())
        self.prompt = prompt if prompt is not None and (prompt.format or prompt.reasoning) else None
        self._replies: dict[int, ReplyParser] = {}  # choice -> its reply so far (a stream that is split)

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
            if self.prompt is not None:
                choice["message"], finish_reason = ReplyParser(self.prompt).message(result.text, finish_reason)
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
        if self.prompt is not None:
            reply = self._replies.setdefault(index, ReplyParser(self.prompt))
            message, finish_reason = reply.delta(delta.text, finish_reason)
            body: dict[str, Any] = {"delta": message}
        else:
            body = {"delta": {"content": delta.text}} if self.chat else {"text": delta.text}
        return {"index": index, **body, "logprobs": logprobs, "finish_reason": finish_reason}


class ReplyParser:
    """One choice's reply split into reasoning, content and tool calls, as the request's prompt says to: as stream
    deltas, or whole."""

    def __init__(self, prompt: ChatPrompt) -> None:
        self.prompt = prompt
        self.reasoning = ReasoningParser(prompt.reasoning, prompt.reasoning_inside) if prompt.reasoning else None
        self.tools = ToolCallParser(prompt.format) if prompt.format is not None else None
        self.ids: list[str] = []  # the calls announced so far
        self.sent: list[int] = []  # characters of each call's arguments sent

    def _split(self, text: str, final: bool) -> tuple[str, str]:
        """The next (reasoning, content) of the reply; content holds no call text."""
        reasoning, content = self.reasoning.feed(text) if self.reasoning else ("", text)
        if final and self.reasoning:
            held = self.reasoning.finish()
            reasoning, content = reasoning + held[0], content + held[1]
        if self.tools is not None:
            content = self.tools.feed(content) + (self.tools.finish() if final else "")
        return (reasoning if self.prompt.include_reasoning else ""), content

    def _calls(self, complete: bool = False) -> list[ToolCall]:
        """The calls parsed so far (`complete`: those whose arguments are complete)."""
        if self.tools is None:
            return []
        return self.tools.complete_calls if complete else self.tools.calls

    def delta(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """A stream chunk's delta for the reply's next text, and its finish_reason ("tool_calls" where it ended
        with calls)."""
        reasoning, content = self._split(text, finish_reason is not None)
        calls = []
        for index, call in enumerate(self._calls()):
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
        delta: dict[str, Any] = {"reasoning_content": reasoning} if reasoning else {}
        if content or not (calls or reasoning):
            delta["content"] = content
        return ({**delta, "tool_calls": calls} if calls else delta), self._finish_reason(finish_reason)

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The whole reply as an assistant message (reasoning_content, content, tool_calls), and its finish_reason."""
        reasoning, content = self._split(text, final=True)
        calls = [
            {"id": new_id("call"), "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
            for call in self._calls(complete=True)
        ]
        message: dict[str, Any] = {"role": "assistant", "content": content or (None if calls else "")}
        if self.reasoning is not None and self.prompt.include_reasoning:
            message["reasoning_content"] = reasoning or None
        return ({**message, "tool_calls": calls} if calls else message), self._finish_reason(finish_reason)

    def _finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if reason == "stop" and self._calls(complete=True) else reason


def embedding_response(
    results: list[GenerationResult], model: str, encoding: str, dimensions: int | None
) -> dict[str, Any]:
    """An embeddings response: each input's vector (its leading `dimensions`, renormalized, where asked) as floats
    or as base64 of little-endian float32, in the inputs' order, and the tokens they took."""
    data = []
    for result in sorted(results, key=lambda r: r.request):
        vector = np.asarray(result.embedding[:dimensions], dtype=np.float64)
        if dimensions is not None:
            vector = vector / max(float(np.linalg.norm(vector)), 1e-12)
        vector = vector.astype("<f4")
        value = base64.b64encode(vector.tobytes()).decode() if encoding == "base64" else vector.tolist()
        data.append({"object": "embedding", "index": result.request, "embedding": value})
    tokens = sum(result.usage.prompt_tokens for result in results)
    return {"object": "list", "data": data, "model": model, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def sse(payload: dict[str, Any]) -> str:
    """One server-sent event carrying a JSON payload."""
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
