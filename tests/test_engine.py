"""The Engine with SamplingParams: seeded sampling, streaming with stop strings, logprobs, usage, n, the
asyncio API and the CLI's sampling flags, chat and --stream (tiny Llama on the torch backend)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import numpy as np
import pytest
import transformers

from llmlower.api import load_engine
from llmlower.cli import main
from llmlower.errors import GenerationError
from llmlower.runtime import AsyncEngine, SamplingParams, Tokenizer

GREEDY = SamplingParams(temperature=0, max_tokens=10)


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return load_engine(tiny_llama, max_num_seqs=8, max_context=64)


def test_a_seeded_request_is_reproducible_alone_and_in_a_batch(engine):
    mine = SamplingParams(temperature=1.2, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True)
    alone = engine.generate(["caches hold keys"], mine, chat=False)[0]
    others = [SamplingParams(temperature=t, seed=s, max_tokens=12) for t, s in [(0.7, None), (1.5, 3), (0, None)]]
    prompts = ["The quick brown fox", "def add(a, b):", "caches hold keys", "東京", "abc", "x y z", "hello", "1 2 3"]
    params = [others[i % 3] for i in range(8)]
    params[2] = mine
    in_batch = engine.generate(prompts, params, chat=False)[2]
    assert in_batch.token_ids == alone.token_ids and len(alone.token_ids) == 12
    other_seed = engine.generate(["caches hold keys"], SamplingParams(**{**_fields(mine), "seed": 8}), chat=False)[0]
    assert other_seed.token_ids != alone.token_ids


def _fields(params: SamplingParams) -> dict:
    return {name: getattr(params, name) for name in params.__dataclass_fields__}


def test_stream_deltas_add_up_and_stop_strings_are_removed(engine):
    free_params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    free = engine.generate(["The quick brown fox"], free_params, chat=False)[0]
    stop = free.text[len(free.text) // 3 : len(free.text) // 3 + 2]  # two characters from the middle
    assert stop.strip(), free.text
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop])
    deltas = list(engine.stream(["The quick brown fox"], params, chat=False))
    result = engine.generate(["The quick brown fox"], params, chat=False)[0]
    assert "".join(d.text for d in deltas) == result.text == free.text[: free.text.index(stop)]
    assert all(stop not in d.text for d in deltas)
    assert deltas[-1].finish_reason == result.finish_reason == "stop" and result.stop == stop
    keep_stop = SamplingParams(**{**_fields(params), "include_stop_str_in_output": True})
    kept = engine.generate(["The quick brown fox"], keep_stop, chat=False)[0]
    assert kept.text == result.text + stop


def test_logprobs_usage_and_n(engine):
    params = SamplingParams(temperature=0.8, seed=1, max_tokens=5, logprobs=True, top_logprobs=3, n=2, ignore_eos=True)
    results = engine.generate(["hello", "abc"], params, chat=False)
    assert [(r.request, r.index) for r in results] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for result in results:
        assert result.usage.completion_tokens == len(result.token_ids) == 5
        assert result.usage.total_tokens == result.usage.prompt_tokens + 5
        assert [lp.token_id for lp in result.logprobs] == result.token_ids
        for lp in result.logprobs:
            assert lp.logprob <= 0 and len(lp.top) == 3 and lp.top[0][1] >= lp.top[-1][1]
        assert result.timing.ttft_s > 0 and result.timing.mean_token_latency_s > 0
    assert results[0].token_ids != results[1].token_ids  # n completions draw different streams


def test_greedy_logprobs_are_the_log_softmax_of_the_logits(engine):
    result = engine.generate(["hello"], SamplingParams(temperature=0, max_tokens=1, logprobs=True), chat=False)[0]
    from llmlower.runtime import StepBatch, sequential_block_tables

    tables = sequential_block_tables(engine.executor, [len(result.prompt_token_ids)])
    logits = engine.executor.step(StepBatch([result.prompt_token_ids], [0], tables))[0].astype(np.float64)
    expected = logits - logits.max() - np.log(np.exp(logits - logits.max()).sum())
    assert result.logprobs[0].logprob == pytest.approx(expected[result.token_ids[0]], abs=1e-5)


def test_invalid_params_name_the_field(engine):
    with pytest.raises(GenerationError, match="top_p"):
        engine.generate(["abc"], SamplingParams(top_p=0))
    with pytest.raises(GenerationError, match="2 SamplingParams for 1 prompts"):
        engine.generate(["abc"], [GREEDY, GREEDY])
    with pytest.raises(GenerationError, match=r"prompts\[1\] is empty"):  # not taken for a chat of no messages
        engine.generate([[5, 6], []], GREEDY)


def test_async_engine_serves_concurrent_streams_and_abandoned_ones(engine):
    async def collect(server: AsyncEngine, prompt: str) -> str:
        return "".join([d.text async for d in server.stream([prompt], GREEDY, chat=False)])

    async def scenario() -> tuple[list[str], list[str]]:
        server = AsyncEngine(engine)
        texts = await asyncio.gather(collect(server, "hello"), collect(server, "The quick brown fox"))
        abandoned = server.stream(["abc"], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), chat=False)
        await anext(abandoned)
        await abandoned.aclose()  # a client that disconnects after one token
        after = await server.generate(["hello", "The quick brown fox"], GREEDY, chat=False)
        return texts, [r.text for r in after]

    streamed, generated = asyncio.run(scenario())
    assert streamed == generated


def test_cli_sampling_flags_stream_and_bad_values(tiny_llama, capsys):
    args = ["generate", str(tiny_llama), "--prompt", "Hello", "--raw", "--max-tokens", "8", "--backend", "torch"]
    assert main([*args, "--json"]) == 0
    greedy = json.loads(capsys.readouterr().out)
    assert main([*args, "--stream"]) == 0
    assert capsys.readouterr().out == greedy["text"] + "\n"
    seeded = [*args, "--json", "--temperature", "0.9", "--top-k", "20", "--seed", "3", "--stop", "zz", "--stop", "\n"]
    assert main(seeded) == 0
    first = json.loads(capsys.readouterr().out)
    assert main(seeded) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == first["token_ids"]
    for flag, value, field in [("--top-p", "0", "top_p"), ("--temperature", "-1", "temperature")]:
        assert main([*args, flag, value]) == 1
        err = capsys.readouterr().err
        assert field in err and "Traceback" not in err


def test_chat_streams_replies_and_keeps_the_conversation(tiny_llama):
    command = [sys.executable, "-m", "llmlower.cli", "chat", str(tiny_llama), "--backend", "torch", "--max-tokens", "4"]
    command += ["--system", "Hi"]
    done = subprocess.run(command, input="hello\nand again\n/exit\n", capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("> ") == 3  # two replies, then the prompt /exit answered


def test_chat_template_equals_transformers(smollm2):
    """SmolLM2's own template: a system message, a multi-turn conversation, with and without the generation
    prompt, as transformers renders them."""
    ours = Tokenizer.from_dir(smollm2)
    reference = transformers.AutoTokenizer.from_pretrained(smollm2)
    conversations = [
        [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a prime."}],
        [
            {"role": "user", "content": "Hi!"},
            {"role": "assistant", "content": "Hello. How can I help?"},
            {"role": "user", "content": "Tell me a joke about caches."},
        ],
        [{"role": "user", "content": "Übersetze: 東京 🙂"}],
    ]
    for messages in conversations:
        for add_generation_prompt in (True, False):
            expected = reference.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=False
            )
            assert ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected
