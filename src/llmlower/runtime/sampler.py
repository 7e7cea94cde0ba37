"""The sampler: a batched numpy sampler for one decode step of many sequences, each with its SamplingParams
(runtime/sampling_params.py).

Each row of logits goes through these steps, in exactly this order (a neutral parameter leaves the row unchanged):

1. structured output: the tokens its grammar does not allow next get -inf (the row's packed bitmask, see
   runtime/structured.py; tokens past the mask's width are not allowed);
2. min_tokens: the tokens that would end the sequence (EOS unless ignore_eos, and stop_token_ids) get -inf
   while the sequence has fewer than min_tokens output tokens;
3. logit bias: logit_bias[token] is added to that token's logit;
4. repetition penalty, over prompt and output tokens: a positive logit is divided by the penalty, a negative one
   multiplied by it;
5. frequency and presence penalties, over output tokens only:
   logit -= frequency_penalty * count + presence_penalty * (count > 0);
6. temperature: logits are divided by it (temperature 0, or below GREEDY_BELOW, is greedy: steps 6 to 9 are
   skipped and the token is the argmax of the logits after step 5);
7. top-k: logits below the k-th largest get -inf (ties with the k-th are kept; k beyond the vocabulary keeps it
   all);
8. top-p: only the smallest set of most likely tokens whose probability reaches top_p is kept (the most likely
   token always; ties with the last one kept);
9. min-p: tokens with probability below min_p times the largest probability are dropped;
10. draw: one inverse-CDF draw from softmax of the result.

Logprobs are log-probabilities under the final distribution, the one the token was drawn from: after step 9,
renormalised over the kept tokens and -inf outside them. For greedy rows the final distribution is log_softmax of
the logits after step 5 (no temperature, no truncation). `Sampler.distribution` returns these log-probabilities.

Steps 1 to 7 work on a float32 copy of the logits (the model's own precision; with float64 and a whole-row
cumulative sum a 16-row step drew in 18 ms, now 5.5); from step 8 a drawing row is held as float32 unnormalised
probabilities exp(logit - max), summed in float64 for top-p, the draw and the logprobs.

A request with a seed owns its own generator, so its tokens depend only on its own logits, never on what else is in
the batch; requests without one share the sampler's generator. Token counts for the penalties are recomputed from
the output ids each step, so the only state a sequence carries is its generator.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..errors import GenerationError
from .sampling_params import SamplingParams


@dataclass
class SequenceSampling:
    """One sequence's sampling state: its params and, when seeded, the generator only it draws from."""

    params: SamplingParams
    index: int = 0  # which of the request's n completions: seeded completions get distinct streams
    generator: np.random.Generator | None = field(init=False, repr=False)

    def __post_init__(self) -> None:
        """Create the sequence's own generator once, from (seed, index), if the request has a seed."""
        seed = self.params.seed
        self.generator = None if seed is None else np.random.default_rng([seed, self.index])


@dataclass(frozen=True)
class SampleResult:
    """One decode step's choices; logprobs and top_logprobs are None for rows that did not ask for them."""

    token_ids: np.ndarray  # int64 [batch]
    logprobs: list[float | None]  # the chosen token's logprob under the final distribution
    top_logprobs: list[list[tuple[int, float]] | None]  # (token, logprob), most likely first, finite ones only


def _checked(
    logits: np.ndarray,
    states: Sequence[SequenceSampling],
    prompt_ids: Sequence[Sequence[int]],
    output_ids: Sequence[Sequence[int]],
    masks: Sequence[np.ndarray | None] | None,
) -> np.ndarray:
    """The logits as an array, with one row per state, prompt, output and mask (when masks are given)."""
    logits = np.asarray(logits)
    rows = len(states) if masks is None else len(masks)
    if logits.ndim != 2 or not len(states) == len(prompt_ids) == len(output_ids) == rows == logits.shape[0]:
        raise ValueError(
            f"logits {logits.shape} need one row per state, prompt, output and mask "
            f"({len(states)}, {len(prompt_ids)}, {len(output_ids)}, {rows})"
        )
    return logits


def allowed_tokens(mask: np.ndarray, vocab: int) -> np.ndarray:
    """A packed bitmask (int32 words, bit t % 32 of word t // 32 set = token t allowed) as bool [vocab]; tokens
    past the mask's width are not allowed."""
    bits = np.unpackbits(np.ascontiguousarray(mask, dtype="<i4").view(np.uint8), bitorder="little").view(bool)
    return bits[:vocab] if bits.size >= vocab else np.concatenate([bits, np.zeros(vocab - bits.size, bool)])


def _is_allowed(mask: np.ndarray, token: int) -> bool:
    """Whether a packed bitmask allows `token` (one bit read, no unpacking)."""
    word = token >> 5
    return word < len(mask) and bool((int(mask[word]) >> (token & 31)) & 1)


def plain_greedy(params: SamplingParams, generated: int) -> bool:
    """Greedy with nothing but a structured output's mask that reorders the logits (bias, penalties, a min_tokens
    mask) and no logprobs."""
    return (
        params.greedy
        and not params.logit_bias
        and params.repetition_penalty == 1.0
        and params.frequency_penalty == params.presence_penalty == 0.0
        and generated >= params.min_tokens
        and not params.logprobs
    )


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax in float64; -inf logits stay -inf."""
    logits = np.asarray(logits, dtype=np.float64)
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def _flatten(ids: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """(row, token) index pairs of ragged per-row token lists, for scattering into a [rows, vocab] array."""
    lengths = [len(row) for row in ids]
    rows = np.repeat(np.arange(len(ids)), lengths)
    tokens = np.concatenate([np.asarray(row, dtype=np.int64) for row in ids]) if rows.size else rows
    return rows, tokens


def _check_vocab(name: str, tokens: np.ndarray, vocab: int) -> None:
    """Token ids a request names or has produced must exist in the model's vocabulary."""
    if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab):
        bad = int(tokens.min() if tokens.min() < 0 else tokens.max())
        raise GenerationError(f"{name} has token id {bad}; the vocabulary has {vocab} tokens", name)


def _token_counts(
    name: str, ids: Sequence[Sequence[int]], rows: np.ndarray, vocab: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each distinct (rows[i], token in ids[i]) and how often it occurs: sparse bincount-style counts."""
    local, tokens = _flatten(ids)
    _check_vocab(name, tokens, vocab)
    keys, counts = np.unique(rows[local] * vocab + tokens, return_counts=True)
    return keys // vocab, keys % vocab, counts


DRAW_BLOCK = 1024  # tokens per block of the two-level inverse CDF


def inverse_cdf(weights: np.ndarray, uniform: np.ndarray) -> np.ndarray:
    """Per row of non-negative weights, the first token whose cumulative weight (float64) passes uniform x the
    row's total; a zero-weight token never does. Block sums find the block, a cumulative sum within it the token:
    a cumulative sum over whole rows took 6 ms for 16 rows of 49,152 tokens."""
    rows, vocab = weights.shape
    starts = np.arange(0, vocab, DRAW_BLOCK)
    cumulative = np.cumsum(np.add.reduceat(weights, starts, axis=1, dtype=np.float64), axis=1)
    target = uniform * cumulative[:, -1]
    block = np.minimum((cumulative <= target[:, None]).sum(axis=1), starts.size - 1)
    before = np.where(block > 0, cumulative[np.arange(rows), block - 1], 0.0)
    columns = starts[block][:, None] + np.arange(DRAW_BLOCK)  # each row's block (past the vocabulary: weight 0)
    within = np.where(columns < vocab, weights[np.arange(rows)[:, None], np.minimum(columns, vocab - 1)], 0.0)
    crossed = np.cumsum(within, axis=1, dtype=np.float64) > (target - before)[:, None]
    # rounding may leave a block's own sum short of its share: then its last token with any weight
    last = DRAW_BLOCK - 1 - np.argmax(within[:, ::-1] > 0, axis=1)
    return starts[block] + np.where(crossed.any(axis=1), crossed.argmax(axis=1), last)


def _apply_top_k(logits: np.ndarray, k: np.ndarray) -> np.ndarray:
    """Keep each row's k largest logits (k per row, each below the vocabulary size); ties with the k-th are kept."""
    kth = logits.shape[1] - k
    threshold = np.partition(logits, np.unique(kth), axis=1)[np.arange(len(k)), kth]
    return np.where(logits < threshold[:, None], -np.inf, logits)


def _apply_top_p(weights: np.ndarray, p: np.ndarray) -> np.ndarray:
    """Keep each row's smallest set of most likely tokens holding a share p of its weight; ties are kept."""
    descending = np.sort(weights, axis=1)[:, ::-1]
    cumulative = np.cumsum(descending.astype(np.float64), axis=1)
    before = cumulative - descending  # weight of the tokens more likely than each
    kept = (before < p[:, None] * cumulative[:, -1:]).sum(axis=1)  # >= 1: nothing is more likely than the first
    return np.where(weights < descending[np.arange(len(p)), kept - 1][:, None], 0.0, weights)


def _apply_min_p(weights: np.ndarray, min_p: np.ndarray) -> np.ndarray:
    """Drop tokens less likely than min_p times the row's most likely one."""
    return np.where(weights < min_p[:, None] * weights.max(axis=1, keepdims=True), 0.0, weights)


def _weights(logits: np.ndarray, params: Sequence[SamplingParams]) -> np.ndarray:
    """Steps 6 to 9 for drawing rows: unnormalised probabilities exp(logit / T - max), 0 outside the kept tokens."""
    vocab = logits.shape[1]
    top_k = np.array([p.top_k if p.top_k < vocab else 0 for p in params])  # int64 whatever the request's k
    top_p = np.array([p.top_p for p in params])
    min_p = np.array([p.min_p for p in params])
    weights = logits / np.array([p.temperature for p in params], dtype=logits.dtype)[:, None]  # a copy, from here on
    rows = np.flatnonzero(top_k > 0)
    if rows.size:
        weights[rows] = _apply_top_k(weights[rows], top_k[rows])
    np.subtract(weights, weights.max(axis=1, keepdims=True), out=weights)
    np.exp(weights, out=weights)
    rows = np.flatnonzero(top_p < 1.0)
    if rows.size:
        weights[rows] = _apply_top_p(weights[rows], top_p[rows])
    rows = np.flatnonzero(min_p > 0.0)
    if rows.size:
        weights[rows] = _apply_min_p(weights[rows], min_p[rows])
    return weights


@dataclass
class Processed:
    """One decode step after steps 1 to 9: every row's logits after step 5, and the final weights of drawing rows."""

    logits: np.ndarray  # float32 [batch, vocab], after the structured output's mask, min_tokens, bias and penalties
    slot: np.ndarray  # [batch]: the row's index in `weights`, or -1 for a greedy row
    weights: np.ndarray  # float32 [drawing rows, vocab], see _weights

    def scores(self, row: int) -> np.ndarray:
        """A row's values, ordered as its final logprobs are: its weights if it draws, else its logits."""
        return self.logits[row] if self.slot[row] < 0 else self.weights[self.slot[row]]

    def probabilities(self, row: int) -> np.ndarray:
        """A drawing row's final distribution, float64 [vocab]: its weights normalised (0 outside the kept tokens)."""
        weights = self.weights[self.slot[row]].astype(np.float64)
        return weights / weights.sum()

    def logprobs(self, row: int, tokens: np.ndarray | slice = slice(None)) -> np.ndarray:
        """Final log-probabilities of a row's `tokens`: its normalised weights if it draws, else log_softmax."""
        if self.slot[row] < 0:
            return log_softmax(self.logits[row])[tokens]
        weights = self.weights[self.slot[row]].astype(np.float64)
        with np.errstate(divide="ignore"):  # log(0) = -inf outside the kept tokens
            return np.log(weights[tokens]) - np.log(weights.sum())

    def top_logprobs(self, row: int, n: int) -> list[tuple[int, float]]:
        """The row's n most likely (token, logprob) pairs, most likely first (ties by token id), -inf ones left out."""
        scores = self.scores(row)
        n = min(n, scores.size)
        if n == 0:
            return []
        top = np.argpartition(-scores, n - 1)[:n]
        logprobs = self.logprobs(row, top)
        return [(int(top[i]), float(logprobs[i])) for i in np.lexsort((top, -logprobs)) if np.isfinite(logprobs[i])]


class Sampler:
    """Chooses the next token of every sequence in a decode step; see the module docstring for the order."""

    def __init__(self, eos_token_ids: Iterable[int] = (), generator: np.random.Generator | None = None) -> None:
        self.eos_token_ids = np.array(sorted(set(eos_token_ids)), dtype=np.int64)
        self.generator = generator if generator is not None else np.random.default_rng()  # for unseeded requests

    def distribution(
        self,
        logits: np.ndarray,
        states: Sequence[SequenceSampling],
        prompt_ids: Sequence[Sequence[int]],
        output_ids: Sequence[Sequence[int]],
        masks: Sequence[np.ndarray | None] | None = None,
    ) -> np.ndarray:
        """Log-probabilities of the final distribution each row's token is chosen from: float64 [batch, vocab]."""
        step = self.processed(logits, states, prompt_ids, output_ids, masks)
        return np.stack([step.logprobs(row) for row in range(len(states))])

    def sample(
        self,
        logits: np.ndarray,
        states: Sequence[SequenceSampling],
        prompt_ids: Sequence[Sequence[int]],
        output_ids: Sequence[Sequence[int]],
        masks: Sequence[np.ndarray | None] | None = None,
    ) -> SampleResult:
        """One token per row (argmax for greedy rows, a draw otherwise) and the logprobs rows asked for; `masks`
        holds a packed bitmask of the allowed tokens (or None) per row."""
        logits = _checked(logits, states, prompt_ids, output_ids, masks)
        if all(plain_greedy(state.params, len(out)) for state, out in zip(states, output_ids, strict=True)):
            # nothing but masks changes the logits' order: the argmax of the model's own logits (saves a
            # copy and the min_tokens masks, ~0.4 ms per step at batch 1), redone only where a mask refuses it
            tokens = logits.argmax(axis=1).astype(np.int64)
            for row, mask in enumerate(() if masks is None else masks):
                if mask is not None and not _is_allowed(mask, tokens[row]):
                    allowed = allowed_tokens(mask, logits.shape[1])
                    tokens[row] = np.where(allowed, logits[row], -np.inf).argmax()
            none = [None] * len(states)
            return SampleResult(tokens, none, list(none))
        step = self.processed(logits, states, prompt_ids, output_ids, masks)
        tokens = np.empty(len(states), dtype=np.int64)
        greedy, drawn = np.flatnonzero(step.slot < 0), np.flatnonzero(step.slot >= 0)
        tokens[greedy] = step.logits[greedy].argmax(axis=1)
        if drawn.size:
            tokens[drawn] = self._draw(step.weights, [states[i] for i in drawn])
        return SampleResult(tokens, *self._logprobs(step, tokens, states))

    def processed(
        self,
        logits: np.ndarray,
        states: Sequence[SequenceSampling],
        prompt_ids: Sequence[Sequence[int]],
        output_ids: Sequence[Sequence[int]],
        masks: Sequence[np.ndarray | None] | None = None,
    ) -> Processed:
        """Steps 1 to 9 of every row on a float32 copy of the logits (the caller's array is not touched), without
        drawing: what sampling draws from, and what speculative decoding's verification and draft proposals
        compare (greedy rows' argmax, drawing rows' final weights)."""
        logits = np.array(_checked(logits, states, prompt_ids, output_ids, masks), dtype=np.float32)
        params = [s.params for s in states]
        for row, mask in enumerate(() if masks is None else masks):
            if mask is not None:
                np.copyto(logits[row], -np.inf, where=~allowed_tokens(mask, logits.shape[1]))  # 20x a bool index
        self._mask_early_stops(logits, params, output_ids)
        self._apply_logit_bias(logits, params)
        self._apply_penalties(logits, params, prompt_ids, output_ids)
        drawn = np.flatnonzero([not p.greedy for p in params])
        slot = np.full(len(params), -1)
        slot[drawn] = np.arange(drawn.size)
        drawing = logits if drawn.size == len(params) else logits[drawn]  # _weights works on a copy of its own
        return Processed(logits, slot, _weights(drawing, [params[i] for i in drawn]))

    def _mask_early_stops(
        self, logits: np.ndarray, params: Sequence[SamplingParams], output_ids: Sequence[Sequence[int]]
    ) -> None:
        """Give -inf to the tokens that would end a sequence still short of its min_tokens."""
        short = [len(out) < p.min_tokens for p, out in zip(params, output_ids, strict=True)]
        rows, tokens = _flatten([self._stop_tokens(p) if s else () for p, s in zip(params, short, strict=True)])
        _check_vocab("eos_token_ids or stop_token_ids", tokens, logits.shape[1])
        logits[rows, tokens] = -np.inf

    def _stop_tokens(self, params: SamplingParams) -> list[int]:
        """The tokens that end a sequence: its stop_token_ids, and EOS unless it ignores EOS."""
        eos = [] if params.ignore_eos else self.eos_token_ids.tolist()
        return [*eos, *params.stop_token_ids]

    @staticmethod
    def _apply_logit_bias(logits: np.ndarray, params: Sequence[SamplingParams]) -> None:
        """Add each row's logit_bias to its tokens."""
        rows, tokens = _flatten([list(p.logit_bias) for p in params])
        _check_vocab("logit_bias", tokens, logits.shape[1])
        logits[rows, tokens] += np.fromiter((b for p in params for b in p.logit_bias.values()), np.float32, rows.size)

    @staticmethod
    def _apply_penalties(
        logits: np.ndarray,
        params: Sequence[SamplingParams],
        prompt_ids: Sequence[Sequence[int]],
        output_ids: Sequence[Sequence[int]],
    ) -> None:
        """Repetition penalty over prompt and output tokens, then frequency and presence over output tokens."""
        vocab = logits.shape[1]
        repetition = np.array([p.repetition_penalty for p in params])
        active = np.flatnonzero(repetition != 1.0)
        seen = [[*prompt_ids[i], *output_ids[i]] for i in active]
        rows, tokens, _ = _token_counts("prompt or output ids", seen, active, vocab)
        values = logits[rows, tokens]
        logits[rows, tokens] = np.where(values > 0, values / repetition[rows], values * repetition[rows])
        frequency = np.array([p.frequency_penalty for p in params])
        presence = np.array([p.presence_penalty for p in params])
        active = np.flatnonzero((frequency != 0.0) | (presence != 0.0))
        rows, tokens, counts = _token_counts("output ids", [output_ids[i] for i in active], active, vocab)
        logits[rows, tokens] -= frequency[rows] * counts + presence[rows]

    def uniform(self, state: SequenceSampling) -> float:
        """One uniform [0, 1) draw from the sequence's own generator, else the shared one."""
        return float((state.generator or self.generator).random())

    def draw(self, weights: np.ndarray, state: SequenceSampling) -> int:
        """One inverse-CDF draw from a row of non-negative weights, with the sequence's generator."""
        return int(inverse_cdf(weights[None], np.array([self.uniform(state)]))[0])

    def _draw(self, weights: np.ndarray, states: Sequence[SequenceSampling]) -> np.ndarray:
        """One inverse-CDF draw per row: seeded rows use their own generator, the others the shared one."""
        uniform = np.empty(len(states))
        shared = [i for i, s in enumerate(states) if s.generator is None]
        uniform[shared] = self.generator.random(len(shared))
        for i, state in enumerate(states):
            if state.generator is not None:
                uniform[i] = state.generator.random()
        return inverse_cdf(weights, uniform)

    @staticmethod
    def _logprobs(
        step: Processed, tokens: np.ndarray, states: Sequence[SequenceSampling]
    ) -> tuple[list[float | None], list[list[tuple[int, float]] | None]]:
        """The chosen token's logprob and the top_logprobs most likely tokens, for rows with logprobs set."""
        chosen: list[float | None] = [None] * len(states)
        top: list[list[tuple[int, float]] | None] = [None] * len(states)
        for row, state in enumerate(states):
            if state.params.logprobs:
                chosen[row] = float(step.logprobs(row, tokens[row : row + 1])[0])
                top[row] = step.top_logprobs(row, state.params.top_logprobs)
        return chosen, top
