"""End to end on the real SmolLM2-135M-Instruct: greedy output equals transformers' own generate."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import transformers

from llmlower.api import load_engine
from llmlower.frontend import example_gguf, load

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about compilers.",
    "List three prime numbers.",
]

pytestmark = pytest.mark.slow


def test_greedy_chat_equals_transformers_generate(smollm2):
    engine = load_engine(smollm2, max_batch=3, max_context=256)
    assert engine.spec.num_kv_heads == 3 and engine.spec.num_heads == 9 and engine.spec.num_layers == 30
    results = engine.generate(PROMPTS, max_tokens=32)
    model = transformers.AutoModelForCausalLM.from_pretrained(smollm2).eval()
    reference_tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2)
    for prompt, result in zip(PROMPTS, results, strict=True):
        text = reference_tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
        assert result.prompt_token_ids == reference_tokenizer(text, add_special_tokens=False).input_ids
        ids = torch.tensor([result.prompt_token_ids])
        expected = model.generate(ids, max_new_tokens=32, do_sample=False)[0, ids.shape[1] :].tolist()
        assert result.token_ids == expected, prompt
    assert "Paris" in results[0].text


def test_gguf_loads_dequantized_to_float16(smollm2):
    """The GGUF file itself (Q4_1 blocks) loads as float16 weights equal to the fp32 checkpoint's, cast."""
    from_gguf = load(example_gguf(), dtype="float16")
    from_checkpoint = load(smollm2)
    assert from_gguf.spec == replace(from_checkpoint.spec, dtype="float16")
    assert from_gguf.num_parameters == from_checkpoint.num_parameters == 134_515_008
    reference = dict(from_checkpoint.module.named_parameters())
    for name, weight in from_gguf.module.named_parameters():
        assert weight.dtype == torch.float16
        assert torch.equal(weight, reference[name].half()), name
