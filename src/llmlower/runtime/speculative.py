"""Speculative decoding: what to speculate with, how proposed tokens are verified, and what it achieved.

A proposer (runtime/proposers.py) guesses up to k next tokens of a decoding sequence; one target step then
computes the sequence's pending token and the k guesses at once and returns k + 1 logits rows. `verify` walks
them: row j is the target's distribution p_j for the token after the pending one and the first j guesses.

- Greedy: a guess is kept while it equals the argmax of p_j; the first mismatch is replaced by that argmax, and
  when every guess is kept the argmax of p_k is a bonus token. The output is exactly what decoding without
  speculation gives.
- Sampling (Leviathan et al. 2023; Chen et al. 2023): guess d_j, drawn from the proposer's distribution q_j, is
  kept with probability min(1, p_j(d_j) / q_j(d_j)); the first rejected one is replaced by a draw from the
  normalised (p_j - q_j)+, and when every guess is kept a bonus token is drawn from p_k. Each emitted token is
  then distributed exactly as the target's p, whatever q is. A proposer without a distribution (prompt lookup)
  proposes a point mass: q_j is one-hot at d_j.

p_j is the sampler's final distribution (runtime/sampler.py: structured-output mask, penalties over the output
so far including d_1..d_j, temperature, top-k/p, min-p), so speculation changes no sampling parameter's meaning.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import GenerationError
from .sampler import Processed, Sampler, SequenceSampling, plain_greedy

METHODS = ("ngram", "draft", "self")


@dataclass(frozen=True)
class SpeculativeConfig:
    """`--speculative ngram|draft:PATH|self:K` and `--num-speculative-tokens`: the proposer and how many tokens
    it may propose per step (prompt lookup matches the last ngram_max..ngram_min tokens; a single repeated token
    is too weak a hint: on SmolLM2 chat, ngram_min 1 kept 6% of its guesses and decoded 0.85x as fast as without
    speculation, ngram_min 2 kept 27% at 1.0x, benchmarks/speculative.py)."""

    method: str
    num_tokens: int = 4
    draft: Path | None = None  # draft: a compiled artifact with the target's tokenizer
    layers: int | None = None  # self: the self-draft `compile --draft-layers K` wrote into the target artifact
    ngram_max: int = 4
    ngram_min: int = 2

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise GenerationError(f"speculative method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if self.num_tokens < 1:
            raise GenerationError(f"num_speculative_tokens must be >= 1, got {self.num_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise GenerationError(f"ngram sizes must satisfy 1 <= min <= max, got {self.ngram_min}..{self.ngram_max}")

    @classmethod
    def parse(cls, text: str, num_tokens: int = 4) -> SpeculativeConfig:
        """From the CLI's spelling: "ngram", "draft:PATH" or "self:K"."""
        method, _, argument = text.partition(":")
        if method == "ngram" and not argument:
            return cls("ngram", num_tokens)
        if method == "draft" and argument:
            return cls("draft", num_tokens, draft=Path(argument))
        if method == "self" and argument.isdigit() and int(argument) > 0:
            return cls("self", num_tokens, layers=int(argument))
        raise GenerationError(f"--speculative {text!r}: expected ngram, draft:PATH or self:K (K layers, K >= 1)")


@dataclass
class Proposal:
    """Up to k guessed tokens and, for a proposer that draws them, the distributions they were drawn from."""

    tokens: list[int] = field(default_factory=list)
    probs: np.ndarray | None = None  # float64 [len(tokens), vocab]; None: each guess is a point mass

    def truncate(self, count: int) -> None:
        """Keep the first `count` guesses."""
        del self.tokens[count:]
        if self.probs is not None:
            self.probs = self.probs[:count]


@dataclass
class Verified:
    """What verification emits for one sequence: the kept guesses, then a correction or bonus token."""

    tokens: list[int]
    accepted: int  # how many of the proposal's tokens were kept
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None


@dataclass
class SpeculationStats:
    """Counters, engine-wide or per completion: verification steps that had a proposal (drafts), tokens proposed
    and accepted, and both by position in the proposal (index 0 is the first guess)."""

    drafts: int = 0
    proposed: int = 0
    accepted: int = 0
    proposed_by_position: list[int] = field(default_factory=list)
    accepted_by_position: list[int] = field(default_factory=list)

    def record(self, proposed: int, accepted: int) -> None:
        self.drafts += 1
        self.proposed += proposed
        self.accepted += accepted
        for counts, n in ((self.proposed_by_position, proposed), (self.accepted_by_position, accepted)):
            counts.extend([0] * (n - len(counts)))
            for position in range(n):
                counts[position] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verification step: the accepted guesses plus the correction or bonus token."""
        return 1 + self.accepted / self.drafts if self.drafts else 0.0

    def acceptance_by_position(self) -> list[float]:
        return [a / p if p else 0.0 for a, p in zip(self.accepted_by_position, self.proposed_by_position, strict=False)]

    def to_dict(self) -> dict[str, object]:
        return {
            "drafts": self.drafts,
            "proposed_tokens": self.proposed,
            "accepted_tokens": self.accepted,
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
            "acceptance_by_position": self.acceptance_by_position(),
        }


def verify(
    sampler: Sampler,
    logits: np.ndarray,
    proposals: Sequence[Proposal],
    states: Sequence[SequenceSampling],
    prompt_ids: Sequence[Sequence[int]],
    output_ids: Sequence[Sequence[int]],
    masks: Sequence[Sequence[np.ndarray | None]] | None = None,
) -> list[Verified]:
    """Verify each sequence's proposal against its len(tokens) + 1 target rows (logits, sequence after sequence);
    `masks`: per sequence, per row, a structured-output bitmask or None (see the module docstring)."""
    counts = [len(p.tokens) + 1 for p in proposals]
    if logits.shape[0] != sum(counts):
        raise ValueError(f"{logits.shape[0]} logits rows for proposals needing {sum(counts)}")
    row_states = [s for s, n in zip(states, counts, strict=True) for _ in range(n)]
    row_prompts = [p for p, n in zip(prompt_ids, counts, strict=True) for _ in range(n)]
    row_outputs = [  # row j's penalties see the output so far and the first j guesses
        [*out, *proposal.tokens[:j]]
        for out, proposal in zip(output_ids, proposals, strict=True)
        for j in range(len(proposal.tokens) + 1)
    ]
    row_masks = None if masks is None else [m for sequence in masks for m in sequence]
    plain = row_masks is None and all(
        plain_greedy(s.params, len(o)) for s, o in zip(row_states, row_outputs, strict=True)
    )  # the model's own argmax decides: no float64 copy of the rows
    step = None if plain else sampler.processed(logits, row_states, row_prompts, row_outputs, row_masks)
    scores = logits if step is None else step.logits
    results, first = [], 0
    for proposal, state, n in zip(proposals, states, counts, strict=True):
        tokens, accepted = _walk(sampler, scores, step, first, proposal, state)
        rows = range(first, first + len(tokens))
        verified = Verified(tokens, accepted)
        if state.params.logprobs:
            verified.logprobs = [float(step.logprobs(r, np.array([t]))[0]) for r, t in zip(rows, tokens, strict=True)]
            verified.top_logprobs = [step.top_logprobs(r, state.params.top_logprobs) for r in rows]
        results.append(verified)
        first += n
    return results


def _walk(
    sampler: Sampler,
    scores: np.ndarray,
    step: Processed | None,
    first: int,
    proposal: Proposal,
    state: SequenceSampling,
) -> tuple[list[int], int]:
    """The tokens one sequence emits, and how many guesses it kept (`scores`: the rows greedy ones take the
    argmax of; `step`: the sampler's processed rows, for drawing ones)."""
    emitted: list[int] = []
    for j, guess in enumerate(proposal.tokens):
        row = first + j
        if state.params.greedy:
            target = int(scores[row].argmax())
            if target != guess:
                return [*emitted, target], j
        else:
            p = step.probabilities(row)
            q = _point(guess, p.size) if proposal.probs is None else proposal.probs[j]
            if sampler.uniform(state) * q[guess] >= p[guess]:  # rejected: u >= p / q
                residual = np.maximum(p - q, 0.0)
                return [*emitted, sampler.draw(residual if residual.sum() > 0 else p, state)], j
        emitted.append(guess)
    row = first + len(proposal.tokens)
    if state.params.greedy:
        return [*emitted, int(scores[row].argmax())], len(emitted)
    return [*emitted, sampler.draw(step.probabilities(row), state)], len(emitted)


def _point(token: int, vocab: int) -> np.ndarray:
    q = np.zeros(vocab)
    q[token] = 1.0
    return q
