"""What the engine gives back: a completion's result (text, tokens, logprobs, usage, timing) and the deltas that
stream it."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class Timing:
    """How long a completion took, from its request's arrival."""

    ttft_s: float = 0.0  # from the request's arrival to its first token
    decode_tokens_per_s: float = 0.0  # tokens after the first, over the time they took
    mean_token_latency_s: float = 0.0  # average time between consecutive tokens after the first
    total_s: float = 0.0  # from arrival to the last token
    queue_s: float = 0.0  # from arrival to the first step that ran it
    inter_token_latencies_s: list[float] = field(default_factory=list)


@dataclass
class Usage:
    """Token counts of a completion, as the OpenAI API reports them."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


@dataclass
class TokenLogprob:
    """A chosen token's logprob and the most likely alternatives, from the distribution it was drawn from."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class GenerationResult:
    """One completion: request `request` (its position in a generate call), completion `index` of its n; an
    embedding model's has its prompt's `embedding` and no tokens."""

    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    finish_reason: str  # "stop" (EOS, a stop token or a stop string) or "length" (max_tokens or the context)
    stop: str | int | None = None  # the stop string or token that ended it
    logprobs: list[TokenLogprob] | None = None
    usage: Usage | None = None
    timing: Timing = field(default_factory=Timing)
    request: int = 0
    index: int = 0
    request_id: str = ""
    speculation: dict[str, Any] | None = None  # with speculative decoding: SpeculationStats.to_dict of this one
    embedding: list[float] | None = None  # an embedding model's: the prompt's pooled, L2-normalized hidden state

    def to_dict(self) -> dict[str, Any]:
        """The result as plain dicts and lists (for JSON)."""
        return asdict(self)


@dataclass
class GenerationDelta:
    """What one step added to a completion, for streaming: `text` may be empty while characters or a
    possible stop string are held back; the last delta of a completion has `finish_reason` and `result` set."""

    request: int  # position in a generate/stream call (0 for add_request)
    index: int
    text: str
    token_id: int
    finish_reason: str | None = None
    logprob: TokenLogprob | None = None
    request_id: str = ""
    result: GenerationResult | None = None
    error: str | None = None  # the engine failed the request (finish_reason "error"); what it was doing
