"""Perplexity over a long text with a sliding window, from any scorer that returns every position's logits.

Windows of `window` tokens advance by `stride`; each token after the first is scored once, by the window
that first reaches it, so every scored token has at least window - stride tokens of context (except those
in the first window). Perplexity = exp(mean negative log-likelihood).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import ArgumentError

Scorer = Callable[[Sequence[int]], np.ndarray]  # token ids -> logits [len(ids), vocab]


@dataclass(frozen=True)
class PerplexityResult:
    perplexity: float
    tokens: int  # tokens scored (all but the first)
    nll: float  # mean negative log-likelihood, nats per token


def _token_nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    logits = logits.astype(np.float64)
    top = logits.max(axis=-1, keepdims=True)
    log_norm = top[:, 0] + np.log(np.exp(logits - top).sum(axis=-1))
    return log_norm - logits[np.arange(len(targets)), targets]


def check_window(window: int, stride: int, note: str = "") -> None:
    """Refuse a window of fewer than 2 tokens and a stride outside [1, window - 1] (windows must overlap: a
    window's first scored token needs one before it), naming the flag (`note` says where the window came from)."""
    if isinstance(window, bool) or not isinstance(window, int) or window < 2:
        raise ArgumentError(f"--window {window!r}: a window needs at least 2 tokens{note}")
    if isinstance(stride, bool) or not isinstance(stride, int) or not 0 < stride < window:
        raise ArgumentError(
            f"--stride {stride!r}: stride must be in [1, window - 1 = {window - 1}], so that windows overlap{note}"
        )


def perplexity(score: Scorer, token_ids: Sequence[int], window: int = 512, stride: int = 256) -> PerplexityResult:
    check_window(window, stride)
    ids = np.asarray(token_ids, dtype=np.int64)
    if len(ids) < 2:
        raise ArgumentError(f"--text: {len(ids)} token(s); perplexity needs at least 2 tokens")
    total, scored, scored_until = 0.0, 0, 1  # token 0 is never predicted
    for begin in range(0, len(ids) - 1, stride):
        end = min(begin + window, len(ids))
        logits = score(ids[begin:end].tolist())
        first = scored_until - begin  # first target index (in window coordinates) not yet scored
        targets = ids[begin + first : end]
        total += float(_token_nll(logits[first - 1 : end - begin - 1], targets).sum())
        scored += len(targets)
        scored_until = end
        if end == len(ids):
            break
    nll = total / scored
    return PerplexityResult(math.exp(nll), scored, nll)
