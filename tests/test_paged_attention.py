"""The paged_attention pass: PAGED programs equal the per-slot ones (--verify runs two sequences sharing prefix
blocks, blocks scattered through the pool), for every attention spelling; its signature, stats and errors."""

from __future__ import annotations

import pytest

from llmlower.cli import main
from llmlower.errors import PassError
from llmlower.passes import build_pipeline, run_pipeline, with_kv_layout
from llmlower.step_io import KVLayout


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt2", "mistral"])
def test_the_paged_program_computes_what_the_slot_program_does(arch, captures):
    """Fused qkv attention (Llama), attention after q/k norms (Qwen3), no rotary (GPT-2), a sliding window
    (Mistral); quantization after the pass is verified on packed inputs too."""
    pipeline = with_kv_layout(build_pipeline(quant="q8"), KVLayout.PAGED, block_size=4)
    program = run_pipeline(captures(arch), pipeline, verify=True)
    record = next(r for r in program.history if r.name == "paged_attention")
    assert record.max_error is not None and record.max_error <= 1e-5
    assert record.stats["rewritten"] == program.spec.num_layers and record.stats["block_size"] == 4
    assert program.kv_layout is KVLayout.PAGED and program.block_size == 4
    shapes = {t.name: t.shape for t in program.inputs}
    assert shapes["input_ids"] == (1, "tokens") and shapes["block_tables"] == ("seqs", "blocks")
    assert shapes["k_pool_0"] == ("pool", 4, program.spec.num_kv_heads, program.spec.head_dim)
    assert program.outputs[0].shape == ("logits", 1, program.spec.vocab_size)


def test_the_pass_refuses_programs_it_cannot_page(captures):
    captured = captures("llama")
    with pytest.raises(PassError, match="run kv_cache first"):
        run_pipeline(captured, ["paged_attention"])
    with pytest.raises(PassError, match="before last_token_logits"):
        run_pipeline(captures("llama"), ["kv_cache", "last_token_logits", "paged_attention"])
    with pytest.raises(PassError, match="power of two"):
        run_pipeline(captures("llama"), ["kv_cache", ("paged_attention", {"block_size": 6})])
    with pytest.raises(PassError, match="drop paged_attention"):
        with_kv_layout(["kv_cache", "paged_attention"], KVLayout.SLOTS)


def test_backends_get_the_layout_they_run(tiny_llama):
    paged = with_kv_layout(build_pipeline(), KVLayout.PAGED, 16)
    names = [p if isinstance(p, str) else p[0] for p in paged]
    assert names[-2:] == ["paged_attention", "last_token_logits"]
    assert with_kv_layout(build_pipeline(), KVLayout.SLOTS) == build_pipeline()


def test_explain(capsys):
    assert main(["passes", "--explain", "paged_attention"]) == 0
    out = capsys.readouterr().out
    assert "block_tables" in out and "block_size" in out
