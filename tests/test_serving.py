"""Serving many requests at once (tiny Llama): requests arriving at different steps under a KV pool small enough
to force chunked prefill, queueing and (paged) preemption give exactly the tokens they give alone, on the torch
reference, the ONNX CPU artifact and the TVM CPU artifact; prefix caching; aborted and cancelled requests free
every block; one engine refuses a second driving thread."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest
import torch
import transformers

from llmlower.api import load_engine
from llmlower.cli import main
from llmlower.errors import GenerationError
from llmlower.runtime import AsyncEngine, Engine, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPT_LENGTHS = [5, 40, 9, 23, 3, 31, 14, 7, 52, 11, 18, 4, 27, 8, 36, 16]  # 16 requests
ARRIVALS = [0, 0, 0, 1, 2, 3, 3, 4, 6, 7, 9, 10, 12, 13, 15, 18]  # the step each request arrives at
BLOCK = 16
PAGED_BLOCK = 4  # the paged engines' blocks: small, so sequences outgrow their blocks often
CONTEXT = 128


def _prompts(vocab: int, lengths: list[int] = PROMPT_LENGTHS, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(5, vocab, (n,), generator=gen).tolist() for n in lengths]


def _assert_all_blocks_free(engine: Engine) -> None:
    stats = engine.stats()
    assert (stats.running, stats.waiting, stats.kv_blocks_used) == (0, 0, 0)
    assert set(engine.blocks.refs) == {0} and not engine.requests


@pytest.fixture(scope="module")
def artifacts(tiny_llama, compiled):
    """The tiny Llama compiled for a backend: artifacts(backend) -> directory."""

    def artifact(backend: str):
        return compiled(tiny_llama, backend, **({"block_size": PAGED_BLOCK} if backend == "tvm" else {}))

    return artifact


def _engine(backend: str, tiny_llama, artifacts, **limits) -> Engine:
    if backend == "torch":
        return load_engine(tiny_llama, max_context=CONTEXT, block_size=PAGED_BLOCK, **limits)
    return Engine.load(artifacts(backend), max_context=CONTEXT, **limits)


@pytest.fixture(scope="module")
def alone(tiny_llama) -> list[list[int]]:
    """Each prompt's greedy tokens served alone (the torch reference, a pool for every sequence)."""
    engine = load_engine(tiny_llama, max_context=CONTEXT)
    prompts = _prompts(engine.spec.vocab_size)
    return [engine.generate([prompt], GREEDY)[0].token_ids for prompt in prompts]


@pytest.mark.parametrize("backend", ["torch", "onnx", "tvm"])
def test_arrivals_under_a_small_pool_give_each_request_its_tokens_alone(backend, tiny_llama, artifacts, alone, serve):
    """A pool of 160 positions (paged, blocks of 4) or 3 slots (ONNX's per-sequence caches), 16 tokens per
    step: prompts longer than that are prefilled in chunks beside the decodes; paged pools preempt."""
    blocks = 3 * CONTEXT // BLOCK if backend == "onnx" else 160 // PAGED_BLOCK
    engine = _engine(backend, tiny_llama, artifacts, num_blocks=blocks, max_num_batched_tokens=16, max_num_seqs=8)
    results = serve(engine, _prompts(engine.spec.vocab_size), ARRIVALS, GREEDY)
    assert [r.token_ids for r in results] == alone
    assert max(PROMPT_LENGTHS) > 16  # chunked
    stats = engine.stats()
    if backend != "onnx":
        assert stats.preemptions >= 1
    assert stats.generation_tokens == 16 * GREEDY.max_tokens
    _assert_all_blocks_free(engine)


@pytest.mark.parametrize("backend", ["torch", "onnx"])
def test_a_pool_for_four_sequences_serves_sixteen_requests(backend, tiny_llama, artifacts, alone):
    block = BLOCK if backend == "onnx" else PAGED_BLOCK
    engine = _engine(backend, tiny_llama, artifacts, num_blocks=4 * CONTEXT // block)
    prompts = _prompts(engine.spec.vocab_size)
    assert [r.token_ids for r in engine.generate(prompts, GREEDY)] == alone
    _assert_all_blocks_free(engine)


@pytest.mark.parametrize("backend", ["torch", "onnx"])
def test_a_cached_system_prompt_is_not_recomputed(backend, long_llama, compiled):
    if backend == "torch":
        engine = load_engine(long_llama, max_context=1024)
        fresh = load_engine(long_llama, max_context=1024, enable_prefix_caching=False)
    else:
        artifact = compiled(long_llama)
        engine = Engine.load(artifact, max_context=1024)
        fresh = Engine.load(artifact, max_context=1024, enable_prefix_caching=False)
    system = " ".join(["caches hold keys and values"] * 30)
    conversations = [[{"role": "system", "content": system}, {"role": "user", "content": q}] for q in ("hi", "why?")]
    first = engine.generate(conversations[:1], GREEDY)[0]
    assert first.usage.prompt_tokens >= 400
    computed = engine.stats().prompt_tokens
    second = engine.generate(conversations[1:], GREEDY)[0]
    pairs = zip(first.prompt_token_ids, second.prompt_token_ids, strict=False)
    shared = next(i for i, (a, b) in enumerate(pairs) if a != b)  # the prompts' common prefix
    assert second.usage.cached_tokens == shared // BLOCK * BLOCK >= 400 - BLOCK
    assert engine.stats().prompt_tokens - computed == second.usage.prompt_tokens - second.usage.cached_tokens
    assert second.token_ids == fresh.generate(conversations[1:], GREEDY)[0].token_ids
    both = engine.generate(conversations, GREEDY)  # concurrently: the prefix is shared (paged) or copied (slots)
    assert [r.token_ids for r in both] == [first.token_ids, second.token_ids]
    assert all(r.usage.cached_tokens >= 400 - BLOCK for r in both)


@pytest.mark.parametrize("backend", ["torch", "onnx", "tvm"])
def test_n_completions_share_the_prompt_and_part_where_they_write(backend, tiny_llama, artifacts, alone):
    """An n = 3 request prefills once; its completions share the prompt's blocks (paged: copy-on-write of the
    partial last block; slots: copied into their own slots) and each decodes exactly as the prompt alone does."""
    engine = _engine(backend, tiny_llama, artifacts)
    prompts = _prompts(engine.spec.vocab_size)
    results = engine.generate(
        [prompts[1], prompts[3]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, n=3)
    )
    assert [r.token_ids for r in results] == [alone[1]] * 3 + [alone[3]] * 3
    assert engine.stats().prompt_tokens == len(prompts[1]) + len(prompts[3])  # each prompt computed once
    _assert_all_blocks_free(engine)


def test_n_completions_wait_for_slots_and_a_request_wider_than_the_pool_is_refused(artifacts, alone):
    """ONNX's per-sequence caches: an n = 2 request is admitted when two slots are free (the second request
    waits for the first), an n = 3 one can never fit two slots and is refused at once."""
    engine = Engine.load(artifacts("onnx"), max_context=CONTEXT, num_blocks=2 * CONTEXT // BLOCK)
    prompts = _prompts(engine.spec.vocab_size)
    greedy_pairs = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, n=2)
    results = engine.generate(prompts[:2], greedy_pairs)
    assert [r.token_ids for r in results] == [alone[0], alone[0], alone[1], alone[1]]
    with pytest.raises(GenerationError, match="n=3 exceeds the 2 sequences the KV pool holds"):
        engine.generate(prompts[:1], SamplingParams(max_tokens=4, n=3))
    _assert_all_blocks_free(engine)


def test_an_n_2_request_keeps_its_forks_slot_from_requests_admitted_beside_it(artifacts, alone):
    """ONNX's per-sequence caches, 4 slots: an n = 2 request and three short prompts arrive at once. The request's
    second slot is held from its admission, so the third short prompt waits instead of taking the slot its fork
    needs when the prompt is done; every answer is the one it gives alone."""
    engine = Engine.load(artifacts("onnx"), max_context=CONTEXT, num_blocks=4 * CONTEXT // BLOCK)
    prompts = _prompts(engine.spec.vocab_size)
    pair = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, n=2)
    results = engine.generate([prompts[1], prompts[0], prompts[2], prompts[4]], [pair, GREEDY, GREEDY, GREEDY])
    assert [r.token_ids for r in results] == [alone[1], alone[1], alone[0], alone[2], alone[4]]
    _assert_all_blocks_free(engine)


def test_a_paged_pool_smaller_than_one_context_is_refused_at_load(artifacts):
    """A pool that cannot hold one sequence of max_context tokens would leave it unschedulable (the engine spun on
    empty steps): it is refused when the engine loads, with the sizes."""
    with pytest.raises(GenerationError, match="6 blocks of 4 tokens holds 24 tokens, less than .* context of 128"):
        Engine.load(artifacts("tvm"), max_context=CONTEXT, num_blocks=6)


def test_aborted_requests_free_every_block_and_the_next_ones_are_right(tiny_llama, alone):
    engine = load_engine(tiny_llama, max_context=CONTEXT, num_blocks=12, max_num_batched_tokens=16)
    prompts = _prompts(engine.spec.vocab_size, [30] * 20, seed=1)
    long = SamplingParams(temperature=0.8, seed=2, max_tokens=60, ignore_eos=True, n=2)
    ids = [engine.add_request(prompt, long) for prompt in prompts]
    seen = dict.fromkeys(ids, 0)
    while engine.has_unfinished():
        for delta in engine.step():
            seen[delta.request_id] += 1
            if seen[delta.request_id] == 3:  # mid-stream: both completions have started
                assert engine.abort(delta.request_id)
    assert set(seen.values()) <= {3, 4}  # every request streamed, then was aborted (its step's other delta: 4)
    _assert_all_blocks_free(engine)
    assert [r.token_ids for r in engine.generate(_prompts(engine.spec.vocab_size), GREEDY)] == alone


def test_cancelled_async_callers_free_every_block(tiny_llama, alone):
    engine = load_engine(tiny_llama, max_context=CONTEXT, num_blocks=16, max_num_batched_tokens=16)
    prompts = _prompts(engine.spec.vocab_size, [25] * 20, seed=3)
    long = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)

    async def scenario() -> list[list[int]]:
        server = AsyncEngine(engine)

        async def read_slowly(prompt: list[int]) -> None:
            async for _ in server.stream([prompt], long, chat=False):
                await asyncio.sleep(0.05)

        readers = [asyncio.create_task(read_slowly(p)) for p in prompts[:10]]
        # one of these alone takes ~0.4 s on 2 cores; they time out mid-generation, or waiting for blocks
        timeouts = [asyncio.wait_for(server.generate([p], long, chat=False), timeout=0.1) for p in prompts[10:]]
        await asyncio.sleep(0.5)
        for task in readers:
            task.cancel()
        outcomes = await asyncio.gather(*readers, *timeouts, return_exceptions=True)
        assert all(isinstance(o, (asyncio.CancelledError, TimeoutError)) for o in outcomes), outcomes
        after = await server.generate(_prompts(engine.spec.vocab_size), GREEDY, chat=False)
        await server.close()
        return [r.token_ids for r in after]

    assert asyncio.run(scenario()) == alone
    _assert_all_blocks_free(engine)


def test_interleaved_streams_share_the_batch_and_a_second_thread_is_refused(tiny_llama, alone):
    engine = load_engine(tiny_llama, max_context=CONTEXT)
    prompts = _prompts(engine.spec.vocab_size)
    active = {0: engine.stream(prompts[:2], GREEDY), 2: engine.stream(prompts[2:4], GREEDY)}
    tokens: dict[int, list[int]] = {i: [] for i in range(4)}
    while active:  # the two generators take turns; each advances the one shared batch
        for offset, stream in list(active.items()):
            delta = next(stream, None)
            if delta is None:
                del active[offset]
            else:
                tokens[offset + delta.request].append(delta.token_id)
    assert [tokens[i] for i in range(4)] == alone[:4]

    engine.add_request(prompts[0], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
    errors: list[str] = []

    def drive() -> None:
        try:
            while engine.has_unfinished():
                engine.step()
        except GenerationError as exc:
            errors.append(str(exc))

    driver = threading.Thread(target=drive)
    driver.start()
    while driver.is_alive() and not errors:
        try:
            engine.step()
        except GenerationError as exc:
            errors.append(str(exc))
    driver.join()
    assert errors and "driven by another thread" in errors[0]


def test_cli_serving_flags(tiny_llama, capsys):
    args = ["generate", str(tiny_llama), "--prompt", "Hello", "--raw", "--max-tokens", "6", "--json"]
    args += ["--backend", "torch"]  # the reference
    assert main([*args, "--max-num-seqs", "2", "--num-blocks", "16", "--block-size", "8", "--no-prefix-caching"]) == 0
    assert len(json.loads(capsys.readouterr().out)["token_ids"]) == 6
    assert main([*args, "--kv-cache-memory", "4000G"]) == 1
    assert "GiB available" in capsys.readouterr().err
    assert main([*args, "--max-num-seqs", "0"]) == 2


def test_the_paged_reference_equals_transformers(tiny_llama):
    engine = load_engine(tiny_llama, max_context=CONTEXT, block_size=4)
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    for prompt in _prompts(engine.spec.vocab_size)[:3]:
        ids = torch.tensor([prompt])
        expected = model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert engine.generate([prompt], GREEDY)[0].token_ids == expected[0, len(prompt) :].tolist()


def test_async_engine_delivers_every_completion_of_an_n_request(tiny_llama, alone):
    """All n completions of a request often finish in the same step: each still reaches its caller."""
    engine = load_engine(tiny_llama, max_context=CONTEXT)
    prompts = _prompts(engine.spec.vocab_size)

    async def scenario() -> list[list[int]]:
        server = AsyncEngine(engine)
        results = await server.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=12, n=3, ignore_eos=True))
        await server.close()
        return [r.token_ids for r in results]

    assert asyncio.run(asyncio.wait_for(scenario(), timeout=120)) == [alone[0]] * 3 + [alone[1]] * 3
