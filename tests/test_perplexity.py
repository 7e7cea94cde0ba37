"""Perplexity: the sliding-window scorer, the CLI's JSON, and pipeline selection by short names."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from llmlower.cli import main
from llmlower.errors import PassError
from llmlower.passes import build_pipeline, parse_quant
from llmlower.runtime.perplexity import perplexity

VOCAB = 11


def bigram_scorer(calls: list[int]):
    """Logits that depend only on the previous token, so every window gives the same per-token scores."""
    table = np.random.default_rng(0).normal(size=(VOCAB, VOCAB)).astype(np.float32)

    def score(ids):
        calls.append(len(ids))
        return table[np.asarray(ids)]

    return score, table


def test_uniform_logits_give_the_vocabulary_size():
    result = perplexity(lambda ids: np.zeros((len(ids), VOCAB), np.float32), list(range(10)) * 5, window=8, stride=3)
    assert result.tokens == 49
    assert result.perplexity == pytest.approx(VOCAB)


def test_sliding_windows_score_each_token_once():
    ids = np.random.default_rng(1).integers(0, VOCAB, size=100).tolist()
    calls: list[int] = []
    score, table = bigram_scorer(calls)
    windowed = perplexity(score, ids, window=16, stride=5)
    whole = perplexity(score, ids, window=100, stride=99)
    logp = table - np.log(np.exp(table).sum(-1, keepdims=True))
    expected = -np.mean([logp[a, b] for a, b in zip(ids[:-1], ids[1:], strict=True)])
    assert windowed.tokens == whole.tokens == 99
    assert windowed.nll == pytest.approx(expected) and whole.nll == pytest.approx(expected)
    assert max(calls[:-1]) == 16
    with pytest.raises(ValueError, match="stride must be in"):
        perplexity(score, ids, window=16, stride=16)


def test_quant_short_names():
    assert parse_quant("none") is None
    assert parse_quant("q8") == {"bits": 8, "group": 32}
    assert parse_quant("q8g128") == {"bits": 8, "group": 128}
    assert parse_quant("q4g32") == {"bits": 4, "group": 32, "symmetric": False}
    assert parse_quant("q4g128-sym") == {"bits": 4, "group": 128, "symmetric": True}
    assert parse_quant("q4g64-zp4") == {"bits": 4, "group": 64, "symmetric": False, "packed_zeros": True}
    with pytest.raises(PassError, match="--quant 'q3g32'"):
        parse_quant("q3g32")


def test_build_pipeline():
    pipeline = build_pipeline(quant="q4g64", keep=["lm_head", "layers.0."])
    assert pipeline[-1] == (
        "quantize_weights",
        {
            "bits": 4,
            "group": 64,
            "symmetric": False,
            "keep_lm_head": True,
            "keep": ["layers.0."],
            "quantize_embedding": False,
        },
    )
    assert build_pipeline(quant="q4g32-sym", lm_head_bits=4)[-1][1]["lm_head_bits"] == 4
    with pytest.raises(PassError, match="need --quant"):
        build_pipeline(lm_head_bits=4)
    assert "last_token_logits" not in build_pipeline(all_logits=True)
    assert build_pipeline("canonicalize, kv_cache") == ["canonicalize", "kv_cache"]
    with pytest.raises(PassError, match="unknown pass 'fuse_all'"):
        build_pipeline("canonicalize,fuse_all")


def test_perplexity_cli_json(tiny_llama, tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 12)
    assert main(["perplexity", str(tiny_llama), "--text", str(text), "--window", "32", "--stride", "16", "--json"]) == 0
    fp32 = json.loads(capsys.readouterr().out)
    assert set(fp32) == {"perplexity", "tokens", "weight_bytes"}
    assert fp32["perplexity"] > 1 and math.isfinite(fp32["perplexity"])
    main(["perplexity", str(tiny_llama), "--text", str(text), "--window", "32", "--quant", "q4g32", "--json"])
    q4 = json.loads(capsys.readouterr().out)
    assert q4["tokens"] == fp32["tokens"]
    assert q4["weight_bytes"] < 0.5 * fp32["weight_bytes"]


def test_decode_scoring_matches_the_prompts_and_takes_any_artifact(tiny_llama, compiled, tmp_path, capsys):
    """--decode scores one token per step: the same perplexity as one step over the window (float32), and it
    scores an artifact that keeps only the last token's logits, which prompt scoring refuses."""
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 6)
    scores = []
    for extra in ([], ["--decode"]):
        assert main(["perplexity", str(tiny_llama), "--text", str(text), "--window", "32", "--json", *extra]) == 0
        scores.append(json.loads(capsys.readouterr().out))
    assert scores[1]["tokens"] == scores[0]["tokens"]
    assert scores[1]["perplexity"] == pytest.approx(scores[0]["perplexity"], rel=1e-4)
    artifact = str(compiled(tiny_llama))
    assert main(["perplexity", artifact, "--text", str(text), "--window", "32"]) == 1
    assert "perplexity --decode" in capsys.readouterr().err
    assert main(["perplexity", artifact, "--text", str(text), "--window", "32", "--json", "--decode"]) == 0
    assert json.loads(capsys.readouterr().out)["perplexity"] == pytest.approx(scores[0]["perplexity"], rel=1e-3)


def test_perplexity_cli_errors(tiny_llama, tmp_path, capsys):
    assert main(["perplexity", str(tiny_llama), "--text", str(tmp_path / "missing.txt")]) != 0
    assert "missing.txt" in capsys.readouterr().err
    assert main(["generate", str(tiny_llama), "--prompt", "x", "--quant", "q5"]) != 0
    err = capsys.readouterr().err
    assert "--quant 'q5'" in err and "Traceback" not in err


def test_passes_explain_one(capsys):
    assert main(["passes", "--explain", "quantize_weights"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("quantize_weights") and "MatMulNBits" in out and "kv_cache" not in out


@pytest.mark.parametrize("family", ["qwen3_5", "jamba"])
def test_a_hybrid_models_perplexity_is_transformers(family, tiny_checkpoints):
    """A hybrid model (recurrent states beside the KV cache) scores through the torch reference: transformers' own
    perplexity of the text, every window from a fresh state."""
    import torch
    import transformers

    from llmlower.api import text_perplexity

    checkpoint = tiny_checkpoints[family]
    result, _ = text_perplexity(checkpoint, "keys and values, caches and states " * 4, build_pipeline(all_logits=True))
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    ids = transformers.AutoTokenizer.from_pretrained(checkpoint)("keys and values, caches and states " * 4)["input_ids"]
    assert len(ids) <= 512  # one window: the whole text from the first token
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1]
    expected = math.exp(torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:])).item())
    assert result.perplexity == pytest.approx(expected, rel=1e-4)
