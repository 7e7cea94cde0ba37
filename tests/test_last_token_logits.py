"""last_token_logits: one logits row per sequence, equal to the last real row of the full program."""

from __future__ import annotations

import copy

import pytest
import torch

from llmlower.errors import PassError
from llmlower.ir.program import example_inputs
from llmlower.passes import FUSION, run_pipeline


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_prefill_of_three_sequences_returns_three_rows(arch, captures):
    full = run_pipeline(captures(arch), ["canonicalize", *FUSION, "kv_cache"])
    last = run_pipeline(copy.deepcopy(full), ["last_token_logits"], verify=True)
    inputs = example_inputs(full, batch=3, tokens=7, context=16, seed=5)
    inputs["input_lens"] = torch.tensor([7, 2, 4])
    inputs["logits_indices"] = torch.arange(3) * 7 + inputs["input_lens"] - 1
    expected = full(**inputs)["logits"]
    actual = last(**inputs)["logits"]
    assert actual.shape == (3, 1, full.spec.vocab_size)
    torch.testing.assert_close(actual[:, 0], expected[torch.arange(3), inputs["input_lens"] - 1], atol=1e-5, rtol=0)
    assert last.outputs[0].shape == ("logits", 1, full.spec.vocab_size)
    inputs["logits_indices"] = torch.tensor([4, 5, 6, 8])  # the first sequence's last three tokens, the second's last
    rows = last(**inputs)["logits"][:, 0]
    torch.testing.assert_close(rows, torch.cat([expected[0, 4:7], expected[1, 1:2]]), atol=1e-5, rtol=0)


def test_needs_kv_cache_first(captures):
    with pytest.raises(PassError, match="run kv_cache first"):
        run_pipeline(captures("llama"), ["last_token_logits"])
