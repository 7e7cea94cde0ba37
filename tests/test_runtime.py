"""The runtime's greedy decode loop on the torch backend, its tokenizer and its independence from torch."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
import transformers

from llmlower.api import load_engine
from llmlower.errors import GenerationError
from llmlower.runtime import Engine, StepBatch, Tokenizer, pack_batch, pad_batch
from llmlower.runtime.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return load_engine(tiny_llama, max_num_seqs=2, max_context=48)


def test_batched_greedy_equals_transformers_generate(engine, tiny_llama):
    prompts = ["The quick brown fox", "def add(a, b):", "東京", "caches hold keys and values"]
    results = engine.generate(
        prompts, SamplingParams(temperature=0, max_tokens=12), chat=False
    )  # 4 prompts in waves of max_num_seqs=2
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    for result in results:
        prompt = torch.tensor([result.prompt_token_ids])
        expected = model.generate(prompt, max_new_tokens=12, do_sample=False, eos_token_id=4, pad_token_id=0)
        assert result.token_ids == expected[0, prompt.shape[1] :].tolist()
        assert result.finish_reason in ("stop", "length")
        assert result.timing.ttft_s > 0


def test_chat_prompt_uses_the_checkpoint_template(engine, tiny_llama):
    reference = transformers.AutoTokenizer.from_pretrained(tiny_llama)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    expected = reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert engine.tokenizer.apply_chat_template(messages) == expected
    assert engine.prompt_token_ids(messages) == reference(expected, add_special_tokens=False).input_ids


def test_stops_at_eos_or_max_tokens(engine):
    free_run = engine.generate(["abc"], SamplingParams(temperature=0, max_tokens=6), chat=False)[0]
    assert free_run.finish_reason == "length" and len(free_run.token_ids) == 6
    third = free_run.token_ids[2]
    stopping = Engine(engine.executor, engine.tokenizer, replace(engine.spec, eos_token_ids=(third,)))
    result = stopping.generate(["abc"], SamplingParams(temperature=0, max_tokens=6), chat=False)[0]
    first_eos = free_run.token_ids.index(third)
    assert result.finish_reason == "stop"
    assert result.token_ids == free_run.token_ids[: first_eos + 1]


def test_prompt_longer_than_context_is_refused(engine):
    with pytest.raises(GenerationError, match=r"prompts\[0\] has \d+ tokens; the context holds 48"):
        engine.generate(["word " * 80], SamplingParams(temperature=0, max_tokens=4), chat=False)


def test_invalid_max_tokens(engine):
    with pytest.raises(GenerationError, match="max_tokens must be"):
        engine.generate(["abc"], SamplingParams(temperature=0, max_tokens=0))


def test_pad_batch_right_pads_and_keeps_positions_in_range():
    padded = pad_batch(StepBatch(tokens=[[7, 8, 9], [5]], past_lens=[0, 10], block_tables=[[0], [1]]))
    assert padded.input_ids.tolist() == [[7, 8, 9], [5, 0, 0]]
    assert padded.position_ids.tolist() == [[0, 1, 2], [10, 10, 10]]
    assert padded.input_lens.tolist() == [3, 1]
    assert padded.past_lens.dtype == np.int64


@pytest.mark.parametrize(
    ("batch", "ids", "positions", "tables", "indices"),
    [
        (  # decode: one token each
            StepBatch(tokens=[[7], [5]], past_lens=[4, 10], block_tables=[[3], [1, 2]]),
            [7, 5],
            [4, 10],
            [[3, 0], [1, 2]],
            [0, 1],
        ),
        (  # a prompt chunk beside a decode, tables of one width
            StepBatch(tokens=[[7, 8, 9], [5]], past_lens=[2, 10], block_tables=[[0, 4], [1, 2]]),
            [7, 8, 9, 5],
            [2, 3, 4, 10],
            [[0, 4], [1, 2]],
            [2, 3],
        ),
        (  # speculative verification: the last two rows of the first sequence
            StepBatch(tokens=[[7, 8, 9], [5]], past_lens=[0, 3], block_tables=[[6], [1]], num_logits=[2, 1]),
            [7, 8, 9, 5],
            [0, 1, 2, 3],
            [[6], [1]],
            [1, 2, 3],
        ),
    ],
)
def test_pack_batch_concatenates_tokens_at_their_positions(batch, ids, positions, tables, indices):
    packed = pack_batch(batch)
    assert packed.input_ids.tolist() == [ids] and packed.position_ids.tolist() == [positions]
    assert packed.block_tables.tolist() == tables and packed.logits_indices.tolist() == indices
    assert packed.input_lens.tolist() == [len(t) for t in batch.tokens]
    assert packed.state_slots is None  # only a hybrid model's steps name state rows
    assert {a.dtype for a in vars(packed).values() if a is not None} == {np.dtype(np.int64)}
    with_rows = pack_batch(replace(batch, state_slots=[2, 0, 1][: len(batch.tokens)]))
    assert with_rows.state_slots.tolist() == [2, 0, 1][: len(batch.tokens)] and with_rows.state_slots.dtype == np.int64


def test_pack_batch_refuses_a_sequence_without_new_tokens():
    with pytest.raises(GenerationError, match="at least one new token"):
        pack_batch(StepBatch(tokens=[[7], []], past_lens=[0, 3], block_tables=[[0], [1]]))


def test_runtime_imports_without_torch_or_transformers(tiny_llama, without_torch):
    done = without_torch(
        f"""
        from llmlower.runtime import Engine, Tokenizer, StepBatch
        tok = Tokenizer.from_dir({str(tiny_llama)!r})
        text = tok.apply_chat_template([{{"role": "user", "content": "hi"}}])
        assert tok.decode(tok.encode(text, add_special_tokens=False), skip_special_tokens=False) == text
        print("ok")
        """
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_tokenizer_without_chat_template(tiny_llama):
    tok = Tokenizer.from_dir(tiny_llama)
    tok.chat_template = None
    with pytest.raises(GenerationError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_bfloat16_program_matches_transformers_in_bfloat16(tiny_llama):
    engine = load_engine(tiny_llama, dtype="bfloat16", max_num_seqs=1, max_context=32)
    assert all(cache.dtype == torch.bfloat16 for cache in engine.executor.caches.values())
    result = engine.generate(["The quick brown fox"], SamplingParams(temperature=0, max_tokens=8), chat=False)[0]
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.bfloat16).eval()
    prompt = torch.tensor([result.prompt_token_ids])
    expected = model.generate(prompt, max_new_tokens=8, do_sample=False, eos_token_id=4, pad_token_id=0)
    assert result.token_ids == expected[0, prompt.shape[1] :].tolist()
