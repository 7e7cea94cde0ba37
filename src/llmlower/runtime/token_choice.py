"""Choosing a step's tokens: the sequences without guesses are sampled in one batch, those with a proposal have it
verified in another (rejection sampling); a batch that fails is retried choice by choice, so that only the
sequences whose own tokens cannot be chosen fail."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .outputs import TokenLogprob
from .request import RequestSequence
from .sampler import Sampler
from .speculative import Proposal, SpeculationStats, verify

Chosen = list[tuple[int, TokenLogprob | None]]  # a sequence's chosen tokens this step, with their logprobs


@dataclass
class Choice:
    """A sequence whose next tokens are chosen this step: its logits rows (one, or one per proposed token plus
    one), its proposal, and the grammar's masks along it."""

    sequence: RequestSequence
    logits: np.ndarray
    proposal: Proposal
    masks: list[np.ndarray | None] | None


def choose_tokens(
    sampler: Sampler, choices: list[Choice], speculation: SpeculationStats
) -> tuple[list[Chosen | None], list[tuple[Choice, Exception]]]:
    """Each choice's (token, logprob) pairs, chosen together; when that fails, each is chosen alone, so only
    the choices that fail alone fail (None, with their exception)."""
    try:
        return _choose(sampler, choices, speculation), []
    except Exception as exc:
        if len(choices) == 1:
            return [None], [(choices[0], exc)]
    emitted: list[Chosen | None] = []
    failed: list[tuple[Choice, Exception]] = []
    for choice in choices:
        tokens, error = choose_tokens(sampler, [choice], speculation)
        emitted += tokens
        failed += error
    return emitted, failed


def _choose(sampler: Sampler, choices: list[Choice], speculation: SpeculationStats) -> list[Chosen]:
    """Sample the plain choices and verify the speculative ones, in one batch each."""
    emitted: list[Chosen] = [[] for _ in choices]
    plain = [i for i, c in enumerate(choices) if not c.proposal.tokens]
    if plain:
        sequences = [choices[i].sequence for i in plain]
        chosen = sampler.sample(
            np.concatenate([choices[i].logits for i in plain]),
            [s.sampling for s in sequences],
            [s.token_ids[: s.prompt_len] for s in sequences],
            [s.output for s in sequences],
            [s.constraint.mask() if s.constraint is not None else None for s in sequences],
        )
        for row, i in enumerate(plain):
            token, logprob = int(chosen.token_ids[row]), chosen.logprobs[row]
            top = chosen.top_logprobs[row] or []
            emitted[i] = [(token, None if logprob is None else TokenLogprob(token, logprob, top))]
    speculated = [i for i, c in enumerate(choices) if c.proposal.tokens]
    if speculated:
        picked = [choices[i] for i in speculated]
        verified = verify(
            sampler,
            np.concatenate([c.logits for c in picked]),
            [c.proposal for c in picked],
            [c.sequence.sampling for c in picked],
            [c.sequence.token_ids[: c.sequence.prompt_len] for c in picked],
            [c.sequence.output for c in picked],
            None if all(c.masks is None for c in picked) else [c.masks or [None] * len(c.logits) for c in picked],
        )
        for i, choice, result in zip(speculated, picked, verified, strict=True):
            choice.sequence.speculation.record(len(choice.proposal.tokens), result.accepted)
            choice.sequence.lookahead = result.accepted + 1  # grows while guesses are kept, 1 after a miss
            speculation.record(len(choice.proposal.tokens), result.accepted)
            logprobs = result.logprobs or [None] * len(result.tokens)
            tops = result.top_logprobs or [[]] * len(result.tokens)
            emitted[i] = [
                (t, None if lp is None else TokenLogprob(t, lp, top))
                for t, lp, top in zip(result.tokens, logprobs, tops, strict=True)
            ]
    return emitted
