"""The interface every backend's execution implements, and the batch layout steps use (numpy only)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class StepBatch:
    """One forward step over several sequences: each has a cache slot, the tokens it brings this step
    (a whole prompt in prefill, one token in decode) and how many tokens it already has in the cache."""

    slots: Sequence[int]
    tokens: Sequence[Sequence[int]]
    past_lens: Sequence[int]


@dataclass(frozen=True)
class PaddedBatch:
    """A StepBatch as the graph takes it: new tokens right-padded to the longest, int64 arrays."""

    input_ids: np.ndarray  # [batch, tokens]
    position_ids: np.ndarray  # [batch, tokens]
    past_lens: np.ndarray  # [batch]
    input_lens: np.ndarray  # [batch]


def pad_batch(batch: StepBatch, pad_id: int = 0) -> PaddedBatch:
    """Right-pad each sequence's new tokens; padding repeats the last real position (it stays in range)."""
    input_lens = np.array([len(t) for t in batch.tokens], dtype=np.int64)
    if (input_lens == 0).any():
        raise ValueError("every sequence in a step needs at least one new token")
    past_lens = np.asarray(batch.past_lens, dtype=np.int64)
    width = int(input_lens.max())
    input_ids = np.full((len(input_lens), width), pad_id, dtype=np.int64)
    for row, tokens in enumerate(batch.tokens):
        input_ids[row, : len(tokens)] = tokens
    steps = np.minimum(np.arange(width)[None, :], input_lens[:, None] - 1)
    return PaddedBatch(input_ids, past_lens[:, None] + steps, past_lens, input_lens)


def last_token_logits(logits: np.ndarray, input_lens: np.ndarray) -> np.ndarray:
    """float32 [batch, vocab] of each sequence's last new token, from logits of every position [batch, tokens,
    vocab] or of the last one only [batch, 1, vocab] (a last_token_logits program)."""
    if logits.shape[1] > 1:
        logits = logits[np.arange(len(input_lens)), input_lens - 1]
    else:
        logits = logits[:, 0]
    return logits.astype(np.float32, copy=False)


class Executor(ABC):
    """Runs a compiled model's steps and owns its KV cache: `max_batch` slots of `max_context` tokens."""

    max_batch: int
    max_context: int

    @abstractmethod
    def step(self, batch: StepBatch) -> np.ndarray:
        """Run one step; returns float32 logits [len(batch.slots), vocab] of each sequence's last new token."""

    @abstractmethod
    def fork(self, parent: int, child: int, length: int) -> None:
        """Slot `child` starts as the first `length` tokens of slot `parent` (the shared prompt of n > 1
        completions); what `child` held before is dropped."""

    @abstractmethod
    def prompt_logits(self, tokens: Sequence[int]) -> np.ndarray:
        """float32 logits [len(tokens), vocab] of every position of a fresh sequence (for scoring text);
        needs a program that computes every position's logits (no last_token_logits)."""
