"""Structured output with llguidance: 50 seeded random JSON schemas (greedy and sampled) in one batch with
unconstrained requests, regex, Lark grammars, any JSON object, stop strings, n > 1, refused schemas, the bitmask
against the sampler, rollback, and the runtime without torch (tiny Llama with 1,024 positions, torch backend)."""

from __future__ import annotations

import asyncio
import json
import random
import re

import jsonschema
import numpy as np
import pytest
from llguidance import LLMatcher, LLTokenizer
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

from llmlower.api import load_engine
from llmlower.errors import GenerationError
from llmlower.runtime import AsyncEngine, SamplingParams, Tokenizer
from llmlower.runtime.sampler import Sampler, SequenceSampling, allowed_tokens
from llmlower.runtime.structured import GrammarCompiler, StructuredOutput

EOS = 4
WORDS = ["id", "name", "tags", "size", "kind", "note", "ok", "items", "price", "meta", "when", "score"]
REGEX = r"\d{3}-[a-z]{2,4}"
LARK = """
start: pair ("," pair){0,3}
pair: KEY "=" VALUE
KEY: /[a-z]{1,5}/
VALUE: /[0-9]{1,3}/
"""
LARK_REGEX = r"[a-z]{1,5}=[0-9]{1,3}(,[a-z]{1,5}=[0-9]{1,3}){0,3}"


@pytest.fixture(scope="module")
def engine(long_llama):
    return load_engine(long_llama, max_num_seqs=128, max_context=1024)


@pytest.fixture(scope="module")
def compiler(long_llama) -> GrammarCompiler:
    return GrammarCompiler(Tokenizer.from_dir(long_llama).to_json(), 320, [EOS])


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """An object of 1-4 bounded properties (nested objects and arrays two levels deep), some of them required."""
    names = rng.sample(WORDS, rng.randint(1, 4))
    return {
        "type": "object",
        "properties": {name: random_value(rng, depth) for name in names},
        "required": [name for name in names if rng.random() < 0.8],
        "additionalProperties": False,
    }


def random_value(rng: random.Random, depth: int) -> dict:
    """A bounded value: every output of it is finite, so that a random model finishes it."""
    kind = rng.choice(["integer", "number", "string", "enum", "boolean"] + ["array", "object"] * (depth < 2))
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 1000)}
    if kind == "number":  # multipleOf bounds the digits after the point
        low = rng.randint(-10, 10)
        return {"type": "number", "minimum": low, "maximum": low + rng.randint(1, 100), "multipleOf": 0.25}
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(0, 8)}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", 1, 2.5, None, True], rng.randint(1, 4))}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "array":
        low = rng.randint(0, 2)
        items = random_value(rng, depth + 1)
        return {"type": "array", "items": items, "minItems": low, "maxItems": low + rng.randint(0, 2)}
    return random_schema(rng, depth + 1)


def test_50_random_schemas_greedy_and_sampled_share_steps_with_free_requests(engine):
    rng = random.Random(0)
    schemas = [random_schema(rng) for _ in range(50)]
    constrained = [
        SamplingParams(temperature=temperature, seed=i, max_tokens=400, structured_output=StructuredOutput(json=s))
        for i, s in enumerate(schemas)
        for temperature in (0.0, 1.0)
    ]
    free = [SamplingParams(temperature=t, seed=i, max_tokens=40, ignore_eos=True) for i, t in enumerate([0, 0.8] * 4)]
    prompts = [f"Record {i} as JSON:" for i in range(len(constrained) + len(free))]
    results = engine.generate(prompts, constrained + free, chat=False)
    for result, params in zip(results, constrained, strict=False):  # the free ones come last
        assert result.finish_reason == "stop", (result.text, params.structured_output.json)
        jsonschema.validate(json.loads(result.text), params.structured_output.json)
    alone = engine.generate(prompts[len(constrained) :], free, chat=False)
    assert [r.token_ids for r in results[len(constrained) :]] == [r.token_ids for r in alone]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_regex_and_lark_grammar(engine, temperature):
    kinds = [StructuredOutput(regex=REGEX), StructuredOutput(grammar=LARK)]
    params = [SamplingParams(temperature=temperature, seed=3, max_tokens=100, structured_output=k) for k in kinds]
    regex, lark = engine.generate(["Code:", "Pairs:"], params, chat=False)
    assert re.fullmatch(REGEX, regex.text) and regex.finish_reason == "stop", regex
    assert re.fullmatch(LARK_REGEX, lark.text) and lark.finish_reason == "stop", lark


def test_json_object_where_a_logit_bias_cannot_bring_back_a_refused_token(engine):
    """Any JSON object; a +100 bias on '}' cannot choose it before '{' (the mask's -inf stays -inf)."""
    close = engine.tokenizer.encode("}", add_special_tokens=False)
    quote = engine.tokenizer.encode('"', add_special_tokens=False)
    bias = {close[0]: 100.0, quote[0]: 50.0}
    params = SamplingParams(
        temperature=0, max_tokens=50, logit_bias=bias, structured_output=StructuredOutput(json_object=True)
    )
    result = engine.generate(["An object:"], params, chat=False)[0]
    assert isinstance(json.loads(result.text), dict) and result.finish_reason == "stop", result


def test_a_stop_string_ends_a_constrained_output_early(engine):
    params = SamplingParams(temperature=0, max_tokens=50, stop="-", structured_output=StructuredOutput(regex=REGEX))
    result = engine.generate(["Code:"], params, chat=False)[0]
    assert re.fullmatch(r"\d{3}", result.text) and (result.finish_reason, result.stop) == ("stop", "-")


def test_max_tokens_cuts_a_constrained_output(engine):
    params = SamplingParams(temperature=0, max_tokens=2, structured_output=StructuredOutput(regex=r"[a-z]{20}"))
    result = engine.generate(["Letters:"], params, chat=False)[0]
    assert len(result.token_ids) == 2 and result.finish_reason == "length" and result.text.isalpha()


def test_n_completions_each_follow_the_grammar_on_their_own(engine):
    output = StructuredOutput(regex=r"[a-z]{3,8}(-[a-z]{3,8}){0,2}")
    params = SamplingParams(temperature=1.0, seed=5, n=3, max_tokens=60, structured_output=output)
    results = engine.generate(["Words:"], params, chat=False)
    assert len({r.text for r in results}) == 3
    for result in results:
        assert re.fullmatch(output.regex, result.text) and result.finish_reason == "stop", result


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"json": {"type": "foo"}}, r"structured_output\.json: not a valid JSON schema: .*foo"),
        ({"json": '{"type": "object"'}, r"structured_output\.json: not a valid JSON schema"),
        ({"json": "[1, 2]"}, r"structured_output\.json: not a valid JSON schema"),
        ({"json": 5}, r"structured_output\.json must be a dict or a str"),
        ({"regex": "(abc"}, r"structured_output\.regex: not a valid regex: [^\n]*unclosed group$"),
        ({"grammar": "start: missing"}, r"structured_output\.grammar: not a valid grammar: .*missing"),
        ({"json_object": 1}, r"structured_output\.json_object must be a bool"),
        ({}, "exactly one of json, json_object, regex, grammar"),
        ({"regex": "a", "grammar": 'start: "a"'}, r"exactly one of .* got \['regex', 'grammar'\]"),
    ],
)
def test_bad_structured_outputs_name_the_field(fields, message):
    with pytest.raises(GenerationError, match=message):
        StructuredOutput(**fields)


def test_a_grammar_refused_by_the_tokenizer_is_refused_before_anything_is_queued(engine):
    """A special token the tokenizer lacks passes llguidance's check alone but not with the tokenizer: the engine
    refuses it when the request is added, queues none of the call's requests, and serves the next call."""
    bad = SamplingParams(structured_output=StructuredOutput(grammar='start: "x" <|nope|>'))
    with pytest.raises(GenerationError, match=r"structured_output\.grammar: not a valid grammar: .*<\|nope\|>"):
        engine.generate(["fine", "bad"], [SamplingParams(), bad], chat=False)
    with pytest.raises(GenerationError, match=r"structured_output\.grammar"):
        engine.add_request("bad", bad, chat=False)
    assert not engine.requests and not engine.has_unfinished()
    params = SamplingParams(temperature=0, max_tokens=20, structured_output=StructuredOutput(regex=REGEX))
    assert re.fullmatch(REGEX, engine.generate(["Code:"], params, chat=False)[0].text)


def test_a_server_compiles_grammars_in_a_worker_within_a_time_limit(engine):
    """AsyncEngine compiles a request's grammar off the event loop and the engine thread: past the limit (0 s here)
    the request is refused naming the field and nothing is queued; the engine then serves the same request."""
    schema = {"type": "object", "properties": {"late": {"type": "integer"}}, "required": ["late"]}
    params = SamplingParams(temperature=0, max_tokens=20, structured_output=StructuredOutput(json=schema))

    async def scenario() -> None:
        server = AsyncEngine(engine, grammar_seconds=0)
        with pytest.raises(GenerationError, match=r"structured_output\.json: took longer than 0 s to compile"):
            await server.generate(["a number"], params)
        assert not engine.has_unfinished()
        await server.close()

    asyncio.run(scenario())
    (result,) = engine.generate(["a number"], params)
    assert isinstance(json.loads(result.text)["late"], int)


def test_sampling_params_check_the_type():
    with pytest.raises(GenerationError, match="structured_output must be a StructuredOutput"):
        SamplingParams(structured_output={"regex": "a"})


def test_the_mask_is_llguidance_bitmask_and_the_sampler_never_picks_outside_it(compiler, long_llama):
    tokenizer = Tokenizer.from_dir(long_llama)
    output = StructuredOutput(regex=r"[0-9]{3}-[a-z]{2,4}")
    constraint = compiler.constraints(output, 1)[0]
    reference = LLMatcher(LLTokenizer(tokenizer.to_json(), eos_token=EOS), output.llguidance_grammar)
    expected = allocate_token_bitmask(1, 320)
    fill_next_token_bitmask(reference, expected)
    mask = constraint.mask()
    assert mask.dtype == np.int32 and mask.shape == (10,) and np.array_equal(mask, expected[0])
    allowed = allowed_tokens(mask, 320)
    starts = {t for t in range(320) if re.fullmatch(r"[0-9]{1,3}|[0-9]{3}-[a-z]{0,4}", tokenizer.decode([t]))}
    assert set(np.flatnonzero(allowed)) == starts  # the tokens that can start a match

    logits = np.random.default_rng(0).normal(size=(64, 320)).astype(np.float32)
    logits[:, np.flatnonzero(~allowed)[0]] = 50.0  # the argmax is a refused token
    sampler = Sampler([EOS], np.random.default_rng(0))
    for params in [SamplingParams(temperature=0), SamplingParams(temperature=0, logprobs=True), SamplingParams()]:
        states = [SequenceSampling(params) for _ in range(64)]
        chosen = sampler.sample(logits, states, [[]] * 64, [[]] * 64, [mask] * 64).token_ids
        assert allowed[chosen].all()
        if params.greedy:
            assert (chosen == np.where(allowed, logits, -np.inf).argmax(axis=1)).all()
    greedy = [SequenceSampling(SamplingParams(temperature=0))] * 2
    assert not allowed[sampler.sample(logits[:2], greedy, [[]] * 2, [[]] * 2).token_ids].any()  # without a mask
    logprobs = sampler.distribution(logits[:1], [SequenceSampling(SamplingParams())], [[]], [[]], [mask])[0]
    assert np.isneginf(logprobs[~allowed]).all() and np.isfinite(logprobs[allowed]).all()


def test_accept_rollback_and_finished(compiler, long_llama):
    tokenizer = Tokenizer.from_dir(long_llama)
    output = StructuredOutput(regex=r"ab(c|de)")
    constraint, other = compiler.constraints(output, 2)
    a, b, c, d, e = (tokenizer.encode(ch, add_special_tokens=False)[0] for ch in "abcde")
    start = constraint.mask()
    constraint.accept(a)
    after_a = constraint.mask()
    constraint.accept(b)
    constraint.accept(c)
    assert constraint.finished and set(np.flatnonzero(allowed_tokens(constraint.mask(), 320))) == {EOS}
    with pytest.raises(GenerationError, match="the grammar is complete"):
        constraint.accept(EOS)
    constraint.rollback(1)
    assert not constraint.finished
    constraint.rollback(1)
    assert np.array_equal(constraint.mask(), after_a)
    constraint.rollback(1)
    assert np.array_equal(constraint.mask(), start) and np.array_equal(other.mask(), start)
    masks, kept = constraint.masks_along([a, b, d, a, e])  # d is fine, the second a is not
    assert kept == 3 and len(masks) == 4 and np.array_equal(masks[0], start) and np.array_equal(masks[1], after_a)
    assert np.array_equal(constraint.mask(), start)  # left where it was
    for token in (a, b, d, e):
        constraint.accept(token)
    assert constraint.finished
    with pytest.raises(GenerationError, match="token .* is not allowed"):
        other.accept(b)
    with pytest.raises(GenerationError, match="cannot roll back"):
        compiler.constraints(output, 1)[0].rollback(1)


def test_the_models_vocabulary_may_be_wider_than_the_tokenizer(long_llama):
    compiler = GrammarCompiler(Tokenizer.from_dir(long_llama).to_json(), 352, [EOS])
    mask = compiler.constraints(StructuredOutput(json_object=True), 1)[0].mask()
    assert mask.shape == (11,) and not allowed_tokens(mask, 352)[320:].any() and allowed_tokens(mask, 352).any()


def test_the_runtime_builds_constraints_without_torch(without_torch, long_llama):
    done = without_torch(
        f"""
        from llmlower.runtime import SamplingParams, Tokenizer
        from llmlower.runtime.structured import GrammarCompiler, StructuredOutput
        output = StructuredOutput(json={{"type": "object", "properties": {{"a": {{"type": "integer"}}}}}})
        params = SamplingParams(structured_output=output)
        compiler = GrammarCompiler(Tokenizer.from_dir({str(long_llama)!r}).to_json(), 320, [{EOS}])
        print(compiler.constraints(params.structured_output, 2)[1].mask().shape)
        """
    )
    assert done.returncode == 0 and done.stdout.strip() == "(10,)", done.stderr


def test_without_llguidance_only_structured_output_is_refused(without_torch):
    done = without_torch(
        """
        import sys
        sys.modules["llguidance"] = None  # not installed: importing it raises ImportError
        from llmlower.errors import GenerationError
        from llmlower.runtime import SamplingParams
        SamplingParams(max_tokens=3)
        from llmlower.runtime.structured import StructuredOutput
        try:
            StructuredOutput(regex="a")
        except GenerationError as error:
            print(error)
        """
    )
    assert done.stdout.strip() == "structured output needs llguidance: pip install 'llmlower[structured]'", done.stderr
