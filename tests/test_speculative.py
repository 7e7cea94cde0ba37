"""Speculative decoding (tiny Llama): prompt lookup and draft proposers, greedy outputs identical to decoding
without speculation on the torch, ONNX and TVM backends, rejection sampling that keeps the target's distribution
(chi-square), rolled-back blocks, the counters, and the CLI."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
import torch

from llmlower.api import load_engine
from llmlower.cli import main
from llmlower.errors import GenerationError
from llmlower.runtime import Engine, SamplingParams
from llmlower.runtime.artifact import ArtifactError
from llmlower.runtime.proposers import NgramProposer
from llmlower.runtime.sampler import Sampler, SequenceSampling
from llmlower.runtime.speculative import Proposal, SpeculativeConfig, verify
from llmlower.runtime.structured import StructuredOutput

CONTEXT = 128
PAGED_BLOCK = 4
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
# Upper 0.1% points of the chi-square distribution by degrees of freedom (NIST/SEMATECH e-Handbook, 1.3.6.7.4).
CHI2_CRITICAL_0_001 = {3: 16.266}


def _prompts(vocab: int, count: int = 20, seed: int = 0) -> list[list[int]]:
    """Random prompts, half of them repeating a phrase (where prompt lookup finds something to propose)."""
    gen = torch.Generator().manual_seed(seed)
    prompts = []
    for i in range(count):
        phrase = torch.randint(5, vocab, (int(torch.randint(3, 9, (1,), generator=gen)),), generator=gen).tolist()
        noise = torch.randint(5, vocab, (int(torch.randint(2, 30, (1,), generator=gen)),), generator=gen).tolist()
        prompts.append(phrase * 3 + noise if i % 2 else noise + phrase)
    return prompts


def _assert_all_blocks_free(engine: Engine) -> None:
    stats = engine.stats()
    assert (stats.running, stats.waiting, stats.kv_blocks_used) == (0, 0, 0)
    assert set(engine.blocks.refs) == {0} and not engine.requests


@pytest.fixture(scope="module")
def plain(tiny_llama) -> list[list[int]]:
    """Each prompt's greedy tokens without speculation (torch reference)."""
    engine = load_engine(tiny_llama, max_context=CONTEXT, max_num_seqs=8)
    return [r.token_ids for r in engine.generate(_prompts(engine.spec.vocab_size), GREEDY, chat=False)]


@pytest.fixture(scope="module")
def artifacts(tiny_llama, compiled):
    """The tiny Llama compiled for a backend with a one-layer self-draft."""

    def artifact(backend: str):
        paged = {"block_size": PAGED_BLOCK} if backend == "tvm" else {}
        return compiled(tiny_llama, backend, draft_layers=1, **paged)

    return artifact


# ---- proposers ----


def test_prompt_lookup_proposes_what_followed_the_latest_match_of_the_longest_suffix():
    proposer = NgramProposer(ngram_max=3, ngram_min=1)
    assert proposer.lookup([1, 2, 3, 4, 5, 9, 2, 3, 4, 7, 2, 3], k=3) == [4, 7, 2]  # "2 3" last seen before 4 7
    assert proposer.lookup([5, 6, 7, 8, 6, 7], k=4) == [8, 6, 7]  # only what exists after the match
    assert proposer.lookup([1, 2, 3], k=2) == []  # nothing repeats
    assert NgramProposer(ngram_max=4, ngram_min=2).lookup([1, 2, 9, 2], k=2) == []  # one token is below ngram_min


def test_speculative_config_parses_the_cli_spelling_and_names_bad_values():
    assert SpeculativeConfig.parse("ngram", 3) == SpeculativeConfig("ngram", 3)
    assert SpeculativeConfig.parse("self:2").layers == 2
    assert str(SpeculativeConfig.parse("draft:/models/d").draft) == "/models/d"
    for bad in ["medusa", "self:0", "self:x", "draft:", "ngram:3"]:
        with pytest.raises(GenerationError, match="--speculative"):
            SpeculativeConfig.parse(bad)
    with pytest.raises(GenerationError, match="num_speculative_tokens"):
        SpeculativeConfig("ngram", 0)


# ---- rejection sampling keeps the target's distribution ----


def _chi_square(observed: np.ndarray, expected: np.ndarray) -> float:
    return float(((observed - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("point_mass", [False, True], ids=["draft", "prompt-lookup"])
def test_verification_emits_tokens_distributed_as_the_target(point_mass):
    """Target rows p0, p1 (context-free here) and a draft q far from them: the first emitted token follows p0,
    and the second (emitted in the same step only after the first guess was kept) follows p1."""
    p = np.array([[0.5, 0.25, 0.15, 0.1, 0.0, 0.0], [0.1, 0.2, 0.3, 0.4, 0.0, 0.0]])
    q = np.array([[0.1, 0.1, 0.2, 0.6, 0.0, 0.0]])
    logits = np.log(np.maximum(p, 1e-300))
    sampler = Sampler(generator=np.random.default_rng(0))
    draft_rng = np.random.default_rng(1)
    state = SequenceSampling(SamplingParams(temperature=1.0))
    first, second = np.zeros(6), np.zeros(6)
    trials = 12_000
    for _ in range(trials):
        guess = int(draft_rng.choice(6, p=q[0]))
        proposal = Proposal([guess], None if point_mass else q)
        (result,) = verify(sampler, logits, [proposal], [state], [[1]], [[]])
        first[result.tokens[0]] += 1
        if result.accepted:
            second[result.tokens[1]] += 1
    kept = p[0] > 0
    assert first[~kept].sum() == 0 and second[~kept].sum() == 0
    assert _chi_square(first[kept], trials * p[0, kept]) < CHI2_CRITICAL_0_001[3]
    assert _chi_square(second[kept], second.sum() * p[1, kept]) < CHI2_CRITICAL_0_001[3]


def test_greedy_verification_keeps_guesses_up_to_the_first_mismatch_and_adds_the_argmax():
    logits = np.eye(5)[[2, 3, 1, 4]] * 5.0  # the target's argmax after each position: 2, 3, 1, 4
    state = SequenceSampling(SamplingParams(temperature=0))
    sampler = Sampler()
    (result,) = verify(sampler, logits, [Proposal([2, 3, 0])], [state], [[1]], [[]])
    assert (result.tokens, result.accepted) == ([2, 3, 1], 2)
    (result,) = verify(sampler, logits, [Proposal([2, 3, 1])], [state], [[1]], [[]])
    assert (result.tokens, result.accepted) == ([2, 3, 1, 4], 3)  # every guess kept: a bonus token


def test_sampled_outputs_with_a_self_draft_follow_the_target_distribution(tiny_llama):
    """Joint distribution of a completion's second and third tokens (the first is sampled after the prompt,
    without speculation), top_k=2: 4 cells given the first token, against the target's own probabilities."""
    params = SamplingParams(temperature=1.0, top_k=2, max_tokens=3, ignore_eos=True, logprobs=True, top_logprobs=2)
    plain = load_engine(tiny_llama, max_context=CONTEXT, max_num_seqs=8)
    prompt = [9, 40, 77, 12, 51]

    def final(tokens: list[int]) -> dict[int, float]:
        result = plain.generate([tokens], SamplingParams(**{**_fields(params), "max_tokens": 1}), chat=False)[0]
        return {token: math.exp(lp) for token, lp in result.logprobs[0].top}

    first = max(final(prompt).items(), key=lambda kv: kv[1])[0]  # condition on the likeliest first token
    expected = {}
    for second, p2 in final([*prompt, first]).items():
        for third, p3 in final([*prompt, first, second]).items():
            expected[(second, third)] = p2 * p3
    speculative = SpeculativeConfig("self", 2, layers=1)
    engine = load_engine(tiny_llama, max_context=CONTEXT, max_num_seqs=64, speculative=speculative)
    quiet = {**_fields(params), "logprobs": False, "top_logprobs": 0}
    runs = [SamplingParams(**{**quiet, "seed": seed}) for seed in range(3000)]
    results = engine.generate([prompt] * len(runs), runs, chat=False)
    pairs = [tuple(r.token_ids[1:]) for r in results if r.token_ids[0] == first]
    assert engine.stats().speculation.proposed > engine.stats().speculation.accepted > 0
    counts = np.array([sum(p == cell for p in pairs) for cell in expected])
    assert counts.sum() == len(pairs) > 1000
    statistic = _chi_square(counts, len(pairs) * np.array(list(expected.values())))
    assert statistic < CHI2_CRITICAL_0_001[len(expected) - 1], f"chi-square {statistic:.1f}"
    _assert_all_blocks_free(engine)


def _fields(params: SamplingParams) -> dict:
    return {name: getattr(params, name) for name in params.__dataclass_fields__}


# ---- greedy equality on every backend ----


@pytest.mark.parametrize("method", ["ngram", "self:1"])
def test_torch_greedy_outputs_equal_decoding_without_speculation(method, tiny_llama, plain):
    config = SpeculativeConfig.parse(method, 4)
    engine = load_engine(tiny_llama, max_context=CONTEXT, max_num_seqs=8, block_size=PAGED_BLOCK, speculative=config)
    results = engine.generate(_prompts(engine.spec.vocab_size), GREEDY, chat=False)
    assert [r.token_ids for r in results] == plain
    stats = engine.stats().speculation
    assert stats.accepted > 0 and stats.proposed > stats.accepted  # guesses kept and guesses rolled back
    assert sum(r.speculation["accepted_tokens"] for r in results) == stats.accepted
    assert stats.acceptance_by_position()[0] >= stats.acceptance_by_position()[-1]
    _assert_all_blocks_free(engine)


@pytest.mark.parametrize("backend", ["onnx", "tvm"])
@pytest.mark.parametrize("method", ["ngram", "self:1"])
def test_compiled_greedy_outputs_equal_decoding_without_speculation(backend, method, artifacts, plain):
    config = SpeculativeConfig.parse(method, 3)
    engine = Engine.load(artifacts(backend), max_context=CONTEXT, max_num_seqs=8, speculative=config)
    results = engine.generate(_prompts(engine.spec.vocab_size), GREEDY, chat=False)
    assert [r.token_ids for r in results] == plain
    assert engine.stats().speculation.accepted > 0
    _assert_all_blocks_free(engine)


def test_a_draft_artifact_speculates_for_a_target_and_a_foreign_tokenizer_is_refused(artifacts, plain, tmp_path):
    target = artifacts("onnx")
    config = SpeculativeConfig("draft", 2, draft=target / "draft-layers-1")
    engine = Engine.load(target, max_context=CONTEXT, max_num_seqs=8, speculative=config)
    assert [r.token_ids for r in engine.generate(_prompts(engine.spec.vocab_size), GREEDY, chat=False)] == plain
    with pytest.raises(ArtifactError, match="compile with --draft-layers 5"):
        Engine.load(target, speculative=SpeculativeConfig("self", 2, layers=5))


def test_rejected_tokens_give_back_their_blocks_and_preempted_sequences_recompute_the_draft(tiny_llama, plain):
    """A pool so small that sequences are preempted while speculating: outputs stay exact, nothing leaks."""
    config = SpeculativeConfig("self", 4, layers=1)
    engine = load_engine(
        tiny_llama, max_context=CONTEXT, max_num_seqs=8, block_size=PAGED_BLOCK, num_blocks=48, speculative=config
    )
    results = engine.generate(_prompts(engine.spec.vocab_size), GREEDY, chat=False)
    assert [r.token_ids for r in results] == plain
    assert engine.stats().preemptions >= 1
    _assert_all_blocks_free(engine)


def test_cli_speculative_flags_report_acceptance(artifacts, capsys):
    artifact = artifacts("onnx")
    code = main(
        [
            "generate", str(artifact), "--prompt", "def add(a, b): def add(a, b): def add", "--raw",
            "--max-tokens", "16", "--temperature", "0", "--speculative", "ngram", "--num-speculative-tokens", "3",
            "--json",
        ]
    )  # fmt: skip
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    assert result["speculation"]["proposed_tokens"] >= result["speculation"]["accepted_tokens"] >= 0
    assert main(["generate", str(artifact), "--prompt", "x", "--speculative", "self:7"]) == 1
    assert "--draft-layers" in capsys.readouterr().err


# ---- with structured output ----


@pytest.mark.parametrize("method", ["ngram", "self:1"])
def test_constrained_outputs_are_verified_under_the_grammars_masks(method, tiny_llama):
    """JSON-schema and regex requests beside free ones, with speculation: each output is the one decoding without
    speculation gives, and it parses and matches."""
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 6}, "tags": {"type": "array", "maxItems": 3,
                       "items": {"enum": ["a", "bb", "ccc"]}}},
        "required": ["name", "tags"],
        "additionalProperties": False,
    }  # fmt: skip
    constrained = [
        SamplingParams(temperature=0, max_tokens=60, structured_output=StructuredOutput(json=schema)),
        SamplingParams(temperature=0, max_tokens=30, structured_output=StructuredOutput(regex=r"(ab|cd){2,5}-\d{3}")),
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
    ]
    prompts = [[9, 40, 77, 12, 51, 9, 40, 77], [3, 3, 3, 3], [20, 21, 22, 20, 21, 22]]
    plain = load_engine(tiny_llama, max_context=CONTEXT, max_num_seqs=8)
    expected = [r.token_ids for r in plain.generate(prompts, constrained, chat=False)]
    config = SpeculativeConfig.parse(method, 4)
    engine = load_engine(tiny_llama, max_context=CONTEXT, max_num_seqs=8, block_size=PAGED_BLOCK, speculative=config)
    results = engine.generate(prompts, constrained, chat=False)
    assert [r.token_ids for r in results] == expected
    assert set(json.loads(results[0].text)) == {"name", "tags"}
    assert re.fullmatch(r"(ab|cd){2,5}-\d{3}", results[1].text)
    assert engine.stats().speculation.proposed > 0
    _assert_all_blocks_free(engine)


def test_logprobs_of_verified_tokens_are_the_targets(tiny_llama):
    """Greedy with logprobs (the sampler's full path): the same tokens and logprobs as without speculation."""
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=True, top_logprobs=2)
    prompts = _prompts(320, count=4)
    plain = load_engine(tiny_llama, max_context=CONTEXT).generate(prompts, params, chat=False)
    engine = load_engine(tiny_llama, max_context=CONTEXT, speculative=SpeculativeConfig("self", 3, layers=1))
    results = engine.generate(prompts, params, chat=False)
    assert engine.stats().speculation.accepted > 0
    for ours, expected in zip(results, plain, strict=True):
        assert ours.token_ids == expected.token_ids
        assert [t.token_id for t in ours.logprobs] == ours.token_ids
        np.testing.assert_allclose(
            [t.logprob for t in ours.logprobs], [t.logprob for t in expected.logprobs], atol=1e-4
        )
        assert [[i for i, _ in t.top] for t in ours.logprobs] == [[i for i, _ in t.top] for t in expected.logprobs]


def test_a_sequence_proposes_one_guess_more_than_its_last_proposal_kept(tiny_llama, plain):
    engine = load_engine(
        tiny_llama, max_context=CONTEXT, max_num_seqs=8, speculative=SpeculativeConfig("self", 4, layers=1)
    )
    seen: dict[int, tuple[int, int]] = {}  # seq_id -> (its drafts, its accepted tokens) at its previous proposal
    checked = []
    propose = engine.proposer.propose

    def recording(sequences, limits):
        for sequence, limit in zip(sequences, limits, strict=True):
            drafts, accepted = sequence.speculation.drafts, sequence.speculation.accepted
            before = seen.get(sequence.seq_id)
            if before is not None and drafts == before[0] + 1:  # verified once since: it kept accepted - before[1]
                checked.append(limit <= accepted - before[1] + 1)
            seen[sequence.seq_id] = (drafts, accepted)
        return propose(sequences, limits)

    engine.proposer.propose = recording
    results = engine.generate(_prompts(engine.spec.vocab_size), GREEDY, chat=False)
    assert [r.token_ids for r in results] == plain
    assert len(checked) > 20 and all(checked)
    assert engine.stats().speculation.proposed_by_position[0] > engine.stats().speculation.proposed_by_position[-1]
