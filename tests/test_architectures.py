"""Every architecture family compiles exactly: tiny random checkpoints of each, compiled by each CPU backend
(fp32), generate transformers' own greedy tokens for 8 prompts at once, the longer ones split in prompt chunks
beside decoding sequences, one of them forked into two completions and every one speculating by prompt lookup (a
hybrid model's recurrent state rolled back past rejected guesses), and every KV block and recurrent-state slot
comes back."""

from __future__ import annotations

import pytest

from llmlower.runtime import Engine, SamplingParams
from llmlower.runtime.speculative import SpeculativeConfig

PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):",
    "Compilers lower graphs to kernels; caches hold keys and values.",
    "12345",
    "caches hold caches hold caches hold",  # prompt lookup guesses from its first token on
    "The lazy dog and the quick brown fox jump over the compilers and their kernels.",
    "東京",
    "keys and values",
]
NEW_TOKENS = 8
BACKENDS = ["onnx", "tvm", "mlir"]
FORKED = 1  # the prompt answered twice (n = 2)


@pytest.fixture(scope="module")
def artifacts(tiny_checkpoints, compiled):
    """(family, backend) -> a compiled fp32 artifact."""
    return lambda family, backend: compiled(tiny_checkpoints[family], backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_tokens_equal_transformers(tiny_arch, backend, artifacts, tiny_checkpoints, greedy_reference):
    speculative = SpeculativeConfig("ngram", num_tokens=3, ngram_min=1)
    engine = Engine.load(
        artifacts(tiny_arch, backend),
        max_num_seqs=9,
        max_context=128,
        max_num_batched_tokens=24,
        speculative=speculative,
    )
    params = [
        SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, n=2 if i == FORKED else 1)
        for i in range(len(PROMPTS))
    ]
    results = engine.generate(PROMPTS, params, chat=False)
    assert len(results) == len(PROMPTS) + 1
    assert max(len(r.prompt_token_ids) for r in results) > 24  # longer than a step: split into prompt chunks
    for result in results:
        expected = greedy_reference(tiny_checkpoints[tiny_arch], result.prompt_token_ids, NEW_TOKENS)
        assert result.token_ids == expected, result.prompt_token_ids
    stats = engine.stats()
    assert stats.speculation.proposed > 0  # guesses were verified, whether kept or not
    assert stats.kv_blocks_used == 0 and stats.state_slots_used == 0
