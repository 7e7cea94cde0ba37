"""A request in flight: its completions as sequences the scheduler runs, each with its sampling state, text
stream, grammar state and output so far. Intake makes them, the engine core steps them, the output processor
turns their tokens into deltas and results."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from .detokenizer import TextStream
from .outputs import GenerationDelta, TokenLogprob
from .sampler import SequenceSampling
from .sampling_params import SamplingParams
from .scheduler import Sequence as SchedulerSequence
from .speculative import SpeculationStats
from .structured import Constraint
from .tokenizer import Message

Prompt = str | list[Message]


@dataclass(eq=False)
class RequestSequence(SchedulerSequence):
    """One completion of a request: the scheduler's sequence plus what choosing and streaming its tokens needs."""

    request: Request | None = None
    index: int = 0
    sampling: SequenceSampling | None = None
    stream: TextStream | None = None
    constraint: Constraint | None = None  # its structured output's grammar state
    speculation: SpeculationStats = field(default_factory=SpeculationStats)
    lookahead: int = 1 << 30  # guesses worth proposing: one more than its last proposal kept (see EngineCore)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    cached_tokens: int = 0
    finished: bool = False
    pooled: np.ndarray | None = None  # an embedding model's sum of the prompt's rows so far (mean pooling)

    @property
    def output(self) -> list[int]:
        """The tokens generated so far."""
        return self.token_ids[self.prompt_len :]


@dataclass(eq=False)
class Request:
    """A prompt and its n completions; those after the first wait in `forks` until the first one's prompt is
    computed, then share its blocks."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    arrival: float
    sequences: list[RequestSequence] = field(default_factory=list)
    forks: list[RequestSequence] = field(default_factory=list)  # completions waiting for the first one's prompt
    scheduled_at: float | None = None
    outbox: deque[GenerationDelta] | None = None  # deltas kept for a generate/stream call, else step() returns them
    lora_slot: int = -1  # the adapter slot it holds (-1: the base model), given back when it is done

    @property
    def done(self) -> bool:
        """Every completion has finished (or was aborted)."""
        return all(s.finished for s in self.sequences)
