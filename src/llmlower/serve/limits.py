"""What one request may ask for: limits the server checks before the engine sees a request, so that no request
costs every other one time per token (stop strings are matched, logit biases and stop token ids applied, at each
token of the request's step) or holds a grammar too large to compile quickly. Each limit is a `serve` flag; a
request over one gets a 400 naming its field. No FastAPI here: the command line reads the flags from this module."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any

from ..errors import GenerationError


class LimitExceeded(GenerationError):
    """A request field over the server's limit; `param` names the field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def _limit(default: int, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class RequestLimits:
    max_n: int = _limit(16, "completions one request may ask for (n)")
    max_stop_strings: int = _limit(16, "stop strings per request")
    max_stop_length: int = _limit(256, "characters of one stop string")
    max_stop_token_ids: int = _limit(256, "stop_token_ids per request")
    max_logit_bias: int = _limit(300, "logit_bias entries per request")
    max_top_logprobs: int = _limit(20, "top_logprobs (chat) or logprobs (completions) per token")
    max_grammar_bytes: int = _limit(64 << 10, "bytes of a request's JSON schema, regex, grammar or tools")
    max_tools: int = _limit(64, "tools one chat request may offer")
    max_embedding_inputs: int = _limit(256, "texts one embeddings request may embed")

    def check(self, request: Any, top_logprobs: int, grammar: tuple[str, Any] | None) -> None:
        """LimitExceeded for the first field of `request` over its limit; `top_logprobs` is the request's count
        under either endpoint's name, `grammar` the (field, value) of its structured output if it has one."""
        stops = [request.stop] if isinstance(request.stop, str) else request.stop or []
        _at_most("n", request.n, self.max_n, "completions")
        _at_most("stop", len(stops), self.max_stop_strings, "stop strings")
        _at_most("stop", max(map(len, stops), default=0), self.max_stop_length, "characters in a stop string")
        _at_most("stop_token_ids", len(request.stop_token_ids or ()), self.max_stop_token_ids, "token ids")
        _at_most("logit_bias", len(request.logit_bias or {}), self.max_logit_bias, "entries")
        name = "top_logprobs" if hasattr(request, "top_logprobs") else "logprobs"
        _at_most(name, top_logprobs, self.max_top_logprobs, "alternatives per token")
        if grammar is not None:
            text = grammar[1] if isinstance(grammar[1], str) else json.dumps(grammar[1])
            _at_most(grammar[0], len(text.encode()), self.max_grammar_bytes, "bytes")
        tools = getattr(request, "tools", None)
        if isinstance(tools, list):  # their schemas become a grammar
            _at_most("tools", len(tools), self.max_tools, "tools")
            described = json.dumps(tools, default=lambda tool: tool.model_dump())
            _at_most("tools", len(described.encode()), self.max_grammar_bytes, "bytes")

    def check_inputs(self, count: int) -> None:
        """LimitExceeded for an embeddings request of more inputs than the limit."""
        _at_most("input", count, self.max_embedding_inputs, "inputs")


def _at_most(param: str, value: int, limit: int, what: str) -> None:
    if value > limit:
        raise LimitExceeded(param, f"{param}: at most {limit} {what} (this server's limit), got {value}")


def limit_flags() -> list[tuple[str, int, str]]:
    """(name, default, help) of every limit, for the command line."""
    return [(f.name, f.default, f.metadata["help"]) for f in fields(RequestLimits)]
