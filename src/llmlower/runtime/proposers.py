"""Proposers for speculative decoding: prompt lookup and draft models (runtime/speculative.py verifies).

- `NgramProposer` (prompt lookup decoding): the sequence's last n tokens (n from ngram_max down to ngram_min) are
  looked up in its earlier tokens, prompt and output; the tokens that followed their latest earlier occurrence are
  proposed. Free, and right often when the output copies its prompt (rewriting, summarising, editing code).
- `DraftProposer`: a smaller model with the target's tokenizer (any compiled artifact, or the self-draft
  `compile --draft-layers K` writes) decodes k tokens ahead. It keeps a KV cache of its own, in a pool of the
  target's shape addressed by the target's block tables (so prefix sharing, copy-on-write and slots carry over);
  what it has computed of each sequence is tracked here and caught up at the next proposal. Its guesses are
  drawn with the request's own sampling parameters, and the distributions they came from go to verification.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from ..errors import GenerationError
from .executor import Executor, StepBatch
from .sampler import Sampler, SequenceSampling
from .speculative import Proposal, SpeculativeConfig


class Speculating(Protocol):
    """What a proposer reads of a sequence."""

    seq_id: int
    token_ids: list[int]
    prompt_len: int
    preemptions: int
    sampling: SequenceSampling


class Proposer(Protocol):
    def propose(self, sequences: Sequence[Speculating], limits: Sequence[int]) -> list[Proposal]:
        """Up to limits[i] guessed next tokens after each sequence's tokens (its last one not yet computed)."""

    def verified(self, sequence: Speculating) -> None:
        """The sequence's tokens changed after verification (guesses kept or rejected)."""

    def finished(self, seq_id: int) -> None:
        """Forget a sequence that left the batch."""


class NgramProposer:
    def __init__(self, ngram_max: int = 4, ngram_min: int = 2) -> None:
        self.ngram_max, self.ngram_min = ngram_max, ngram_min

    def propose(self, sequences: Sequence[Speculating], limits: Sequence[int]) -> list[Proposal]:
        return [Proposal(self.lookup(s.token_ids, k)) for s, k in zip(sequences, limits, strict=True)]

    def lookup(self, tokens: Sequence[int], k: int) -> list[int]:
        """The up to k tokens after the latest earlier occurrence of the longest matching suffix."""
        ids = np.asarray(tokens, dtype=np.int64)
        for n in range(min(self.ngram_max, len(ids) - 1), self.ngram_min - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(ids[:-1], n)  # every earlier n-gram
            starts = np.flatnonzero((windows == ids[-n:]).all(axis=1))
            if starts.size:
                follow = starts[-1] + n
                return ids[follow : follow + k].tolist()
        return []

    def verified(self, sequence: Speculating) -> None:
        pass

    def finished(self, seq_id: int) -> None:
        pass


class DraftProposer:
    def __init__(
        self,
        executor: Executor,
        sampler: Sampler,
        block_table: Callable[[int], list[int]],
    ) -> None:
        """`block_table(seq_id)`: the target's table for a sequence, which the draft's pool shares."""
        self.executor, self.sampler, self.block_table = executor, sampler, block_table
        self.computed: dict[int, tuple[int, int]] = {}  # seq_id -> (its preemptions then, tokens in the draft's KV)

    def propose(self, sequences: Sequence[Speculating], limits: Sequence[int]) -> list[Proposal]:
        proposals = [Proposal() for _ in sequences]
        drawn_from: list[list[np.ndarray]] = [[] for _ in sequences]  # a sampled sequence's q for each guess
        active = [i for i, k in enumerate(limits) if k > 0]
        for j in range(max(limits, default=0)):
            active = [i for i in active if limits[i] > j]
            if not active:
                break
            tokens, past = [], []
            for i in active:
                sequence = sequences[i]
                ids = [*sequence.token_ids, *proposals[i].tokens]
                done = self._computed(sequence)
                tokens.append(ids[done:])
                past.append(done)
                self.computed[sequence.seq_id] = (sequence.preemptions, len(ids))
            tables = [self.block_table(sequences[i].seq_id) for i in active]
            logits = self.executor.step(StepBatch(tokens, past, tables))
            chosen, probs = self._draw(logits, [sequences[i] for i in active], [proposals[i].tokens for i in active])
            for row, i in enumerate(active):
                proposals[i].tokens.append(chosen[row])
                if probs[row] is not None:
                    drawn_from[i].append(probs[row])
        for proposal, q in zip(proposals, drawn_from, strict=True):
            if q:
                proposal.probs = np.stack(q)
        return proposals

    def verified(self, sequence: Speculating) -> None:
        """Only positions holding kept tokens stay valid in the draft's cache: those before the last token."""
        preemptions, done = self.computed.get(sequence.seq_id, (sequence.preemptions, 0))
        self.computed[sequence.seq_id] = (preemptions, min(done, len(sequence.token_ids) - 1))

    def finished(self, seq_id: int) -> None:
        self.computed.pop(seq_id, None)

    def _computed(self, sequence: Speculating) -> int:
        """Tokens of the sequence whose KV the draft holds (none after the sequence was preempted: its blocks
        were given away)."""
        preemptions, done = self.computed.get(sequence.seq_id, (sequence.preemptions, 0))
        return done if preemptions == sequence.preemptions else 0

    def _draw(
        self, logits: np.ndarray, sequences: Sequence[Speculating], guessed: Sequence[list[int]]
    ) -> tuple[list[int], list[np.ndarray | None]]:
        """Each sequence's next guess under its own sampling parameters (penalties see the guesses so far), and
        for sampled ones the distribution it was drawn from."""
        states = [s.sampling for s in sequences]
        prompts = [s.token_ids[: s.prompt_len] for s in sequences]
        outputs = [[*s.token_ids[s.prompt_len :], *g] for s, g in zip(sequences, guessed, strict=True)]
        if all(s.params.greedy for s in states):
            return self.sampler.sample(logits, states, prompts, outputs).token_ids.tolist(), [None] * len(states)
        step = self.sampler.processed(logits, states, prompts, outputs)
        tokens: list[int] = []
        probs: list[np.ndarray | None] = []
        for row, state in enumerate(states):
            if state.params.greedy:
                tokens.append(int(step.logits[row].argmax()))
                probs.append(None)
            else:
                q = step.probabilities(row)
                tokens.append(self.sampler.draw(q, state))
                probs.append(q)
        return tokens, probs


def make_proposer(
    config: SpeculativeConfig | None,
    draft: Executor | None,
    target: Executor,
    sampler: Sampler,
    block_table: Callable[[int], list[int]],
) -> Proposer | None:
    """The proposer `config` asks for; a draft model's executor must address the same blocks as the target's."""
    if config is None:
        if draft is not None:
            raise GenerationError("a draft model was given without a speculative configuration")
        return None
    if config.method == "ngram":
        return NgramProposer(config.ngram_max, config.ngram_min)
    if draft is None:
        raise GenerationError(f"speculative method {config.method!r} needs the draft model's executor")
    shape = ("kv_layout", "block_size", "num_blocks", "max_context")
    mismatched = [name for name in shape if getattr(draft, name) != getattr(target, name)]
    if mismatched:
        found = ", ".join(f"{n} {getattr(draft, n)} vs {getattr(target, n)}" for n in mismatched)
        raise GenerationError(f"the draft model's KV cache must match the target's: {found}")
    return DraftProposer(draft, sampler, block_table)
