"""Sampling: parameter validation, the documented processing order, penalties, truncation, the drawn
distribution (chi-square), per-request seeds inside a batch, greedy decoding and logprobs."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from llmlower.errors import GenerationError
from llmlower.runtime.sampler import DRAW_BLOCK, Sampler, SequenceSampling, inverse_cdf, log_softmax
from llmlower.runtime.sampling_params import SamplingParams

EOS = 7


def final_logprobs(logits, params: SamplingParams, prompt=(), output=()) -> np.ndarray:
    """The log-probabilities of one row's final distribution."""
    sampler = Sampler([EOS], np.random.default_rng(0))
    return sampler.distribution(np.asarray([logits], np.float32), [SequenceSampling(params)], [prompt], [output])[0]


def support(logits, params: SamplingParams) -> set[int]:
    """The tokens the final distribution of one row can draw."""
    return set(np.flatnonzero(np.isfinite(final_logprobs(logits, params))).tolist())


def draws(logits, params: SamplingParams, count: int, seed: int = 0) -> np.ndarray:
    """`count` tokens drawn for the same row in one batch, from a seeded shared generator."""
    sampler = Sampler([EOS], np.random.default_rng(seed))
    batch = np.repeat(np.asarray([logits], np.float32), count, axis=0)
    states = [SequenceSampling(params) for _ in range(count)]
    return sampler.sample(batch, states, [[]] * count, [[]] * count).token_ids


def softmax(x: np.ndarray) -> np.ndarray:
    """Reference softmax of one row, written independently of the sampler."""
    e = np.exp(x - x.max())
    return e / e.sum()


# ---- parameters ----


def test_defaults_follow_vllm():
    p = SamplingParams()
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (1.0, 1.0, 0, 0.0)
    assert (p.repetition_penalty, p.frequency_penalty, p.presence_penalty) == (1.0, 0.0, 0.0)
    assert (p.max_tokens, p.min_tokens, p.n, p.seed, p.stop, p.logit_bias) == (16, 0, 1, None, (), {})


def test_values_are_normalised_and_replace_revalidates():
    p = SamplingParams(stop="\n", stop_token_ids=[5], temperature=1, logit_bias={np.int64(3): 2})
    assert p.stop == ("\n",) and p.stop_token_ids == (5,)
    assert isinstance(p.temperature, float) and p.logit_bias == {3: 2.0}
    assert dataclasses.replace(p, top_k=4).stop == ("\n",)
    with pytest.raises(GenerationError, match="top_p"):
        dataclasses.replace(p, top_p=0.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = 2.0


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("top_p", 0.0, r"\(0, 1\]"),
        ("top_p", 1.5, r"\(0, 1\]"),
        ("temperature", -1.0, r"\[0, inf\)"),
        ("temperature", math.nan, "finite"),
        ("max_tokens", 0, ">= 1"),
        ("max_tokens", True, "an int"),
        ("max_tokens", 2.0, "an int"),
        ("stop", 5, "str or a list of"),
        ("stop", ["ok", 3], "str or a list of"),
        ("stop", [""], "non-empty"),
        ("top_logprobs", -1, ">= 0"),
        ("top_k", -2, ">= -1"),
        ("min_p", 1.5, r"\[0, 1\]"),
        ("repetition_penalty", 0.0, r"\(0, inf\)"),
        ("frequency_penalty", 2.5, r"\[-2, 2\]"),
        ("presence_penalty", "1", r"\[-2, 2\]"),
        ("seed", "42", "an int"),
        ("seed", 1.5, "an int"),
        ("seed", -1, ">= 0"),
        ("n", 0, ">= 1"),
        ("logprobs", 1, "a bool"),
        ("ignore_eos", None, "a bool"),
        ("logit_bias", {"5": 1.0}, "int token ids"),
        ("logit_bias", [1.0], "dict"),
        ("stop_token_ids", [-1], "ints >= 0"),
    ],
)
def test_invalid_parameters_name_the_field_and_the_range(field, value, expected):
    """The message starts with the field, which the error also carries (a server names it as the bad param)."""
    with pytest.raises(GenerationError, match=f"^{field}") as error:
        SamplingParams(**{field: value})
    assert repr(value) in str(error.value)
    assert error.match(expected)
    assert error.value.field == field


def test_invalid_combinations_and_bias_values():
    with pytest.raises(GenerationError, match=r"min_tokens must be <= max_tokens \(4\), got 5") as error:
        SamplingParams(min_tokens=5, max_tokens=4)
    assert error.value.field == "min_tokens"
    with pytest.raises(GenerationError, match="top_logprobs .* unless logprobs"):
        SamplingParams(top_logprobs=3)
    with pytest.raises(GenerationError, match=r"logit_bias\[2\] .* \[-100, 100\]") as error:
        SamplingParams(logit_bias={2: 101.0})
    assert error.value.field == "logit_bias"


def test_token_ids_outside_the_vocabulary_are_rejected():
    with pytest.raises(GenerationError, match="logit_bias has token id 9; the vocabulary has 8"):
        final_logprobs(np.zeros(8), SamplingParams(logit_bias={9: 1.0}))
    with pytest.raises(GenerationError, match="stop_token_ids has token id 8"):
        final_logprobs(np.zeros(8), SamplingParams(min_tokens=1, stop_token_ids=[8]))


# ---- order ----


@pytest.mark.parametrize(
    ("temperature", "top_p", "documented", "reversed_order"),
    [
        # softmax([1, .5, 0]) = [.51, .31, .19] keeps all three for 0.85; softmax([2, 1, 0]) = [.67, .24, .09] two
        (2.0, 0.85, {0, 1, 2}, {0, 1}),
        # softmax([4, 2, 0]) = [.87, .12, .02] keeps one token for 0.7; softmax([2, 1, 0]) keeps two
        (0.5, 0.7, {0}, {0, 1}),
    ],
)
def test_temperature_comes_before_top_p(temperature, top_p, documented, reversed_order):
    logits = np.array([2.0, 1.0, 0.0, -30.0, -30.0, -30.0, -30.0, -30.0])
    params = SamplingParams(temperature=temperature, top_p=top_p)
    assert support(logits, SamplingParams(top_p=top_p)) == reversed_order  # top-p at temperature 1
    assert support(logits, params) == documented
    assert set(draws(logits, params, 3000).tolist()) == documented  # every kept token is drawn, no other


def test_top_k_comes_before_top_p_and_min_p():
    logits = np.log([0.4, 0.3, 0.2, 0.1])
    # top-k 2 leaves [.57, .43]: top-p 0.5 then keeps only token 0 (before top-k it would keep 0 and 1)
    assert support(logits, SamplingParams(top_p=0.5)) == {0, 1}
    assert support(logits, SamplingParams(top_k=2, top_p=0.5)) == {0}
    # top-p 0.75 keeps {0, 1, 2} and min-p 0.3 (threshold .12) keeps them all; min-p first would leave
    # [.44, .33, .22], of which top-p 0.75 keeps only {0, 1}
    assert support(logits, SamplingParams(min_p=0.3)) == {0, 1, 2}
    assert support(logits, SamplingParams(top_p=0.75, min_p=0.3)) == {0, 1, 2}


def test_logit_bias_comes_before_repetition_penalty_and_penalties_before_temperature():
    logits = np.array([-1.0, 1.0, 0.5, 0.0])
    # bias first: (-1 + 2) / 2 = 0.5 (penalty first would give -1 * 2 + 2 = 0); then temperature 2 halves it
    params = SamplingParams(logit_bias={0: 2.0}, repetition_penalty=2.0, temperature=2.0)
    np.testing.assert_allclose(final_logprobs(logits, params, prompt=[0]), log_softmax([0.25, 0.5, 0.25, 0.0]))
    # presence 0.5 then temperature 2: (1 - 0.5) / 2, not 1 / 2 - 0.5
    params = SamplingParams(presence_penalty=0.5, temperature=2.0)
    np.testing.assert_allclose(final_logprobs(logits, params, output=[1]), log_softmax([-0.5, 0.25, 0.25, 0.0]))


# ---- penalties ----


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_prompt_and_output():
    logits = np.array([2.0, -2.0, 3.0, -1.0, 4.0])
    final = final_logprobs(logits, SamplingParams(repetition_penalty=2.0), prompt=[0, 1, 0], output=[3])
    np.testing.assert_allclose(final, log_softmax([1.0, -4.0, 3.0, -2.0, 4.0]))


def test_frequency_scales_with_the_count_and_presence_does_not_over_output_tokens_only():
    logits = np.array([1.0, 1.0, 1.0, 1.0])
    output = [0, 0, 0, 1]
    frequency = final_logprobs(logits, SamplingParams(frequency_penalty=0.5), prompt=[2, 2], output=output)
    np.testing.assert_allclose(frequency, log_softmax([1.0 - 1.5, 1.0 - 0.5, 1.0, 1.0]))
    presence = final_logprobs(logits, SamplingParams(presence_penalty=0.5), prompt=[2, 2], output=output)
    np.testing.assert_allclose(presence, log_softmax([0.5, 0.5, 1.0, 1.0]))
    both = final_logprobs(logits, SamplingParams(frequency_penalty=-0.25, presence_penalty=1.0), output=output)
    np.testing.assert_allclose(both, log_softmax([1.0 + 0.75 - 1.0, 1.0 + 0.25 - 1.0, 1.0, 1.0]))


def test_penalties_use_each_rows_own_tokens_in_a_batch():
    sampler = Sampler([], np.random.default_rng(0))
    states = [SequenceSampling(SamplingParams(frequency_penalty=1.0, repetition_penalty=2.0)) for _ in range(2)]
    final = sampler.distribution(np.ones((2, 3), np.float32), states, [[0], [1]], [[2, 2], []])
    np.testing.assert_allclose(final, log_softmax([[0.5, 1.0, 0.5 - 2.0], [1.0, 0.5, 1.0]]))


# ---- truncation edge cases ----


def test_neutral_truncation_leaves_the_distribution_unchanged():
    logits = np.random.default_rng(1).normal(size=16)
    unchanged = final_logprobs(logits, SamplingParams())
    np.testing.assert_allclose(unchanged, log_softmax(logits.astype(np.float32)), rtol=1e-6)
    for params in [SamplingParams(top_k=17), SamplingParams(top_k=16), SamplingParams(top_k=-1)]:
        np.testing.assert_array_equal(final_logprobs(logits, params), unchanged)
    for params in [SamplingParams(top_p=1.0), SamplingParams(min_p=0.0)]:
        np.testing.assert_array_equal(final_logprobs(logits, params), unchanged)


def test_top_k_keeps_the_k_largest_and_top_k_1_is_greedy():
    logits = np.array([0.1, 3.0, -1.0, 2.0, 2.5])
    assert support(logits, SamplingParams(top_k=3)) == {1, 3, 4}
    assert set(draws(logits, SamplingParams(top_k=1, temperature=5.0), 500).tolist()) == {1}


def test_a_top_k_beyond_the_vocabulary_keeps_it_all_beside_other_rows():
    """One hostile row (k = 2**63, or any k past the vocabulary) is the whole vocabulary; its batch still samples."""
    vocab = 64
    logits = np.random.default_rng(0).normal(size=(3, vocab)).astype(np.float32)
    params = [SamplingParams(top_k=2**63, seed=1), SamplingParams(top_k=5, seed=2), SamplingParams(top_k=10**30)]
    sampler = Sampler([EOS], np.random.default_rng(0))
    states = [SequenceSampling(p) for p in params]
    final = sampler.distribution(logits, states, [[]] * 3, [[]] * 3)
    np.testing.assert_allclose(final[0], log_softmax(logits[0].astype(np.float64)), rtol=1e-5)
    assert np.isfinite(final[1]).sum() == 5
    assert len(sampler.sample(logits, states, [[]] * 3, [[]] * 3).token_ids) == 3


@pytest.mark.parametrize("temperature", [1e-300, 5e-324, 1e-6])
def test_temperatures_below_1e_5_are_greedy(temperature):
    """A subnormal temperature would overflow the logits into NaN weights; it is greedy instead."""
    params = SamplingParams(temperature=temperature, logprobs=True, top_logprobs=2)
    assert params.greedy
    logits = np.array([0.1, 3.0, -1.0, 2.0])
    np.testing.assert_allclose(final_logprobs(logits, params), log_softmax(logits))


def test_min_p_drops_tokens_below_a_fraction_of_the_largest_probability():
    logits = np.log([0.5, 0.3, 0.15, 0.05])
    assert support(logits, SamplingParams(min_p=0.2)) == {0, 1, 2}  # threshold 0.1
    assert support(logits, SamplingParams(min_p=0.7)) == {0}  # threshold 0.35
    assert support(logits, SamplingParams(min_p=1.0)) == {0}


# ---- distribution ----

# Upper 0.1% points of the chi-square distribution (significance 0.001) by degrees of freedom, from the standard
# table in the NIST/SEMATECH e-Handbook of Statistical Methods, section 1.3.6.7.4 ("Critical Values of the
# Chi-Square Distribution"); cross-checked against the Wilson-Hilferty approximation below.
CHI2_CRITICAL_0_001 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322}


def wilson_hilferty(df: int, z: float = 3.090232) -> float:
    """Approximate chi-square quantile: df * (1 - 2/(9 df) + z sqrt(2/(9 df)))^3, z the normal 0.999 quantile."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def test_draws_follow_the_tempered_top_p_distribution():
    logits = np.array([3.0, 2.5, 2.0, 1.5, 1.0, 0.0, -1.0, -2.0])
    temperature, top_p, count = 0.8, 0.9, 20_000
    tempered = softmax(logits / temperature)
    order = np.argsort(-tempered)
    kept = order[: int(np.searchsorted(np.cumsum(tempered[order]), top_p)) + 1]  # smallest set reaching top_p
    assert 2 < len(kept) < len(logits)
    expected = np.zeros_like(tempered)
    expected[kept] = tempered[kept] / tempered[kept].sum()

    tokens = draws(logits, SamplingParams(temperature=temperature, top_p=top_p), count, seed=1234)
    observed = np.bincount(tokens, minlength=len(logits))
    assert observed[expected == 0].sum() == 0  # nothing outside the top-p set
    statistic = float((((observed[kept] - count * expected[kept]) ** 2) / (count * expected[kept])).sum())
    df = len(kept) - 1
    assert CHI2_CRITICAL_0_001[df] == pytest.approx(wilson_hilferty(df), rel=0.02)
    assert statistic < CHI2_CRITICAL_0_001[df], f"chi-square {statistic:.2f} with {df} degrees of freedom"


def test_the_blockwise_inverse_cdf_draws_the_token_a_whole_row_cumulative_sum_draws():
    rng = np.random.default_rng(7)
    vocab = 2 * DRAW_BLOCK + 37  # a partial last block
    weights = rng.random((64, vocab), dtype=np.float32) ** 8  # mostly tiny weights, a few large ones
    weights[rng.random(weights.shape) < 0.3] = 0.0  # zero-weight tokens everywhere
    weights[::4, DRAW_BLOCK : 2 * DRAW_BLOCK] = 0.0  # and whole blocks of them
    uniform = rng.random(64)
    uniform[:2] = (0.0, np.nextafter(1.0, 0.0))
    cdf = np.cumsum(weights.astype(np.float64), axis=1)
    expected = np.argmax(cdf > uniform[:, None] * cdf[:, -1:], axis=1)
    tokens = inverse_cdf(weights, uniform)
    np.testing.assert_array_equal(tokens, expected)
    assert (weights[np.arange(64), tokens] > 0).all()


# ---- seeds ----


def run_steps(sampler: Sampler, params: list[SamplingParams], logits: np.ndarray, steps: int) -> list[list[int]]:
    """Decode `steps` steps of every row against fixed per-step logits [steps, batch, vocab]; each row's tokens."""
    states = [SequenceSampling(p) for p in params]
    prompts = [[1, 2, 3]] * len(params)
    outputs: list[list[int]] = [[] for _ in params]
    for step in range(steps):
        tokens = sampler.sample(logits[step], states, prompts, outputs).token_ids
        for output, token in zip(outputs, tokens.tolist(), strict=True):
            output.append(token)
    return outputs


def test_a_seeded_request_draws_the_same_tokens_alone_and_inside_any_batch():
    steps, vocab = 20, 64
    target = SamplingParams(seed=7, temperature=0.9, top_k=50, top_p=0.95, frequency_penalty=0.3)
    others = [
        SamplingParams(),
        SamplingParams(seed=7, temperature=1.3),  # same seed, other params
        SamplingParams(temperature=0.0),
        SamplingParams(seed=123, min_p=0.1),
        SamplingParams(top_k=5, repetition_penalty=1.2),
        SamplingParams(temperature=0.5, presence_penalty=1.0),
        SamplingParams(seed=8, logit_bias={3: 5.0}),
    ]
    rng = np.random.default_rng(99)
    alone_logits = rng.normal(size=(steps, 1, vocab)).astype(np.float32)
    alone = run_steps(Sampler([EOS]), [target], alone_logits, steps)[0]

    batch = [*others[:3], target, *others[3:]]
    batch_logits = rng.normal(size=(steps, len(batch), vocab)).astype(np.float32)
    batch_logits[:, 3] = alone_logits[:, 0]
    together = run_steps(Sampler([EOS]), batch, batch_logits, steps)
    assert together[3] == alone
    assert run_steps(Sampler([EOS]), [target], alone_logits, steps)[0] == alone  # a fresh state repeats itself
    different_seed = dataclasses.replace(target, seed=8)
    assert run_steps(Sampler([EOS]), [different_seed], alone_logits, steps)[0] != alone


def test_completions_of_one_seeded_request_draw_from_distinct_streams():
    params = SamplingParams(seed=3)
    first, second = SequenceSampling(params, index=0), SequenceSampling(params, index=1)
    assert first.generator.random() != second.generator.random()
    assert SequenceSampling(params, index=1).generator.random() == SequenceSampling(params, index=1).generator.random()


def test_a_seeded_state_keeps_one_generator_across_steps():
    flat = np.zeros((20, 1, 64), np.float32)  # uniform logits: a generator re-seeded every step repeats its token
    tokens = run_steps(Sampler(), [SamplingParams(seed=5)], flat, 20)[0]
    assert len(set(tokens)) > 5


# ---- greedy, bias, min_tokens, logprobs ----


def test_greedy_picks_the_argmax_of_the_processed_logits():
    logits = np.random.default_rng(5).normal(size=(6, 50)).astype(np.float32)
    states = [SequenceSampling(SamplingParams(temperature=0.0)) for _ in range(6)]
    result = Sampler().sample(logits, states, [[]] * 6, [[]] * 6)
    np.testing.assert_array_equal(result.token_ids, logits.argmax(axis=1))
    # a repetition penalty on the argmax moves greedy to the runner-up
    row = np.array([[1.0, 3.0, 2.0]], np.float32)
    state = [SequenceSampling(SamplingParams(temperature=0.0, repetition_penalty=2.0))]
    assert Sampler().sample(row, state, [[1]], [[]]).token_ids.tolist() == [2]


def test_logit_bias_forces_a_token():
    logits = np.random.default_rng(6).normal(size=32)
    assert set(draws(logits, SamplingParams(logit_bias={17: 100.0}), 200).tolist()) == {17}
    assert set(draws(logits, SamplingParams(temperature=0.0, logit_bias={17: 100.0}), 5).tolist()) == {17}


def test_min_tokens_masks_eos_and_stop_token_ids_until_enough_output():
    logits = np.array([[0.0, 1.0, 2.0, 0.0, 0.0, 0.0, 0.0, 9.0]], np.float32)  # EOS (7) is the argmax, then 2
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[2])
    sampler = Sampler([EOS])
    state = [SequenceSampling(params)]
    assert sampler.sample(logits, state, [[0]], [[5]]).token_ids.tolist() == [1]  # one output: both masked
    assert sampler.sample(logits, state, [[0]], [[5, 5]]).token_ids.tolist() == [EOS]  # two: masks lifted
    ignore = [SequenceSampling(dataclasses.replace(params, ignore_eos=True))]
    assert sampler.sample(logits, ignore, [[0]], [[5]]).token_ids.tolist() == [EOS]  # EOS is no stop then


def test_logprobs_are_those_of_the_final_distribution():
    logits = np.array([2.0, 1.0, 0.0, -1.0, 0.5, -3.0])
    params = SamplingParams(temperature=0.5, top_k=3, logprobs=True, top_logprobs=5, seed=11)
    sampler = Sampler([EOS], np.random.default_rng(0))
    result = sampler.sample(np.asarray([logits], np.float32), [SequenceSampling(params)], [[]], [[]])
    token = int(result.token_ids[0])
    kept = logits[[0, 1, 4]] / 0.5  # top-3 after temperature 0.5
    final = dict(zip([0, 1, 4], kept - np.log(np.exp(kept).sum()), strict=True))
    assert token in final
    assert result.logprobs[0] == pytest.approx(final[token])
    assert [t for t, _ in result.top_logprobs[0]] == [0, 1, 4]  # only the three with finite logprobs
    assert sum(math.exp(lp) for _, lp in result.top_logprobs[0]) == pytest.approx(1.0)
    probs = np.exp(final_logprobs(logits, params))
    assert probs.sum() == pytest.approx(1.0) and set(np.flatnonzero(probs).tolist()) == {0, 1, 4}
    assert result.logprobs[0] == pytest.approx(math.log(probs[token]))


def test_greedy_logprobs_are_the_log_softmax_of_the_processed_logits():
    logits = np.array([[0.5, 2.0, 1.0, -1.0]], np.float32)
    params = SamplingParams(temperature=0.0, presence_penalty=1.0, logprobs=True, top_logprobs=2)
    result = Sampler().sample(logits, [SequenceSampling(params)], [[]], [[1]])
    processed = np.array([0.5, 1.0, 1.0, -1.0])
    expected = processed - np.log(np.exp(processed).sum())
    assert result.token_ids.tolist() == [1]  # ties go to the lower id
    assert result.logprobs[0] == pytest.approx(expected[1])
    assert result.top_logprobs[0] == [(1, pytest.approx(expected[1])), (2, pytest.approx(expected[2]))]


def test_rows_without_logprobs_get_none():
    states = [SequenceSampling(SamplingParams()), SequenceSampling(SamplingParams(logprobs=True))]
    result = Sampler().sample(np.zeros((2, 4), np.float32), states, [[], []], [[], []])
    assert result.logprobs[0] is None and result.top_logprobs[0] is None
    assert result.logprobs[1] == pytest.approx(math.log(0.25)) and result.top_logprobs[1] == []


def test_the_callers_logits_are_not_modified():
    logits = np.array([[1.0, -1.0, 2.0]], np.float32)
    before = logits.copy()
    params = SamplingParams(repetition_penalty=2.0, logit_bias={0: 1.0}, temperature=0.5, top_k=2)
    Sampler().sample(logits, [SequenceSampling(params)], [[0, 1]], [[]])
    np.testing.assert_array_equal(logits, before)


def test_plain_greedy_rows_take_the_argmax_and_everything_else_still_applies():
    """A batch of plain greedy rows takes the model's argmax as the full path does (ties: the first token);
    a bias, a penalty or a pending min_tokens in the batch still changes the choice."""
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((6, 50)).astype(np.float32)
    logits[0, [3, 7]] = 9.0  # a tie
    sampler = Sampler(eos_token_ids=[int(logits[1].argmax())])
    plain = [SequenceSampling(SamplingParams(temperature=0))] * 6
    tokens = sampler.sample(logits, plain, [[1]] * 6, [[2]] * 6)
    full = sampler.sample(
        logits, [SequenceSampling(SamplingParams(temperature=0, logprobs=True))] * 6, [[1]] * 6, [[2]] * 6
    )
    assert tokens.token_ids.tolist() == full.token_ids.tolist() == logits.argmax(axis=1).tolist()
    assert tokens.token_ids[0] == 3 and tokens.logprobs == [None] * 6
    biased = SequenceSampling(SamplingParams(temperature=0, logit_bias={0: 100}))
    assert sampler.sample(logits, [biased, *plain[1:]], [[1]] * 6, [[2]] * 6).token_ids[0] == 0
    waiting = SequenceSampling(SamplingParams(temperature=0, min_tokens=5, max_tokens=8))
    assert (
        sampler.sample(logits, [plain[0], waiting, *plain[2:]], [[1]] * 6, [[2]] * 6).token_ids[1] != logits[1].argmax()
    )
