"""The engine on a prebuilt tiny Llama ONNX artifact, as a deployment host runs it: under make test-runtime, in
an environment where torch and transformers are not installed at all."""

from __future__ import annotations

import importlib.util
import os

import pytest

from llmlower.runtime import Engine, SamplingParams
from tests.runtime.conftest import PREBUILT_ENV

PROMPTS = ["The quick brown fox", "Caches hold keys and values", "One two three four five six seven"]
GREEDY = SamplingParams(temperature=0, max_tokens=16)


@pytest.mark.skipif(
    PREBUILT_ENV not in os.environ, reason="the main environment has torch; make test-runtime's has not"
)
def test_the_runtime_environment_has_no_torch():
    assert importlib.util.find_spec("torch") is None and importlib.util.find_spec("transformers") is None


def test_greedy_tokens_are_each_prompts_own_in_a_batch(prebuilt):
    """Three prompts decoded together (continuous batching over the paged cache) get the tokens each gets alone,
    and every block returns to the pool."""
    artifact = prebuilt("long-llama-onnx")
    alone_engine = Engine.load(artifact, max_num_seqs=1, max_context=256)
    alone = [alone_engine.generate([prompt], GREEDY, chat=False)[0].token_ids for prompt in PROMPTS]
    engine = Engine.load(artifact, max_num_seqs=3, max_context=256)
    results = engine.generate(PROMPTS, GREEDY, chat=False)
    assert [r.token_ids for r in results] == alone
    assert engine.stats().kv_blocks_used == 0


def test_streamed_text_is_the_generated_text(prebuilt):
    engine = Engine.load(prebuilt("long-llama-onnx"), max_num_seqs=2, max_context=256)
    (result,) = engine.generate(PROMPTS[:1], GREEDY)
    streamed = "".join(delta.text for delta in engine.stream(PROMPTS[:1], GREEDY))
    assert streamed == result.text
