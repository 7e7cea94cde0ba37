"""The engine's results as OpenAI's responses: whole completions and chat completions, their stream chunks
(server-sent events), logprobs and usage."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from ..runtime import GenerationDelta, GenerationResult, Tokenizer, TokenLogprob


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
    """Builds one request's response objects (whole, or chunk by chunk) in its endpoint's format."""

    def __init__(self, tokenizer: Tokenizer, model: str, chat: bool, n: int) -> None:
        self.tokenizer, self.model, self.chat, self.n = tokenizer, model, chat, n
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())

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
            if self.chat:
                choice["message"] = {"role": "assistant", "content": result.text}
            else:
                choice["text"] = result.text
            choices.append({**choice, "logprobs": logprobs, "finish_reason": result.finish_reason})
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
        body = {"delta": {"content": delta.text}} if self.chat else {"text": delta.text}
        return {"index": index, **body, "logprobs": logprobs, "finish_reason": delta.finish_reason}


def sse(payload: dict[str, Any]) -> str:
    """One server-sent event carrying a JSON payload."""
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
