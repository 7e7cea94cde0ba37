"""Bad command lines a new user might type: each ends with one line on stderr that names the flag (or file) at
fault and exit status 1 (2 for argparse's own usage errors and the CLI's lower bounds), never a traceback.

Everything runs in-process through llmlower.cli.main on the tiny Llama checkpoint, one ONNX artifact compiled
from it, and copies of the checkpoint whose tokenizer.json is broken; most cases fail before a model loads."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from transformers.activations import ACT2FN

from llmlower.cli import main

TEXT = "The quick brown fox jumps over the lazy dog. " * 30


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch) -> None:
    """generate MODEL compiles into the artifact cache: a temporary one here, never the user's."""
    monkeypatch.setenv("LLMLOWER_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def paths(tiny_llama, compiled, tmp_path_factory) -> dict[str, str]:
    """Placeholders of the invocations: {A} artifact, {C} checkpoint, {T} text file, {F} a file that is no model,
    {D} a directory that is no model, {O} an output path never written, {BAD_<kind>} broken checkpoints."""
    root = tmp_path_factory.mktemp("cli-errors")
    artifact = compiled(tiny_llama)
    (root / "text.txt").write_text(TEXT, encoding="utf-8")
    (root / "binary.txt").write_bytes(bytes(range(256)) * 4)
    (root / "notes").mkdir()
    (root / "notes" / "readme.md").write_text("not a model")
    tokenizer_json = (tiny_llama / "tokenizer.json").read_text(encoding="utf-8")
    broken = {
        "truncated": tokenizer_json[: len(tokenizer_json) // 2],
        "notjson": "this is not JSON",
        "list": "[1, 2, 3]",
        "notatokenizer": '{"version": "1.0", "vocab": {"a": 0}}',
    }
    found = {
        "A": artifact,
        "C": tiny_llama,
        "T": root / "text.txt",
        "B": root / "binary.txt",
        "F": root / "notes" / "readme.md",
        "D": root / "notes",
        "O": root / "never-written",
    }
    for kind, content in broken.items():
        checkpoint = shutil.copytree(tiny_llama, root / f"bad-{kind}")
        (checkpoint / "tokenizer.json").write_text(content, encoding="utf-8")
        found[f"BAD_{kind}"] = checkpoint
    return {key: str(value) for key, value in found.items()}


# (command line with placeholders, exit status, what the message must say)
CASES = [
    # generate: sampling flags are SamplingParams' fields, named as fields (top_k for --top-k)
    ("generate {A} --prompt hi --n 0", 1, "n must be an int >= 1, got 0"),
    ("generate {A} --prompt hi --n 300 --kv-cache-memory 1M", 1, "n=300 exceeds the 16 sequences the KV pool holds"),
    ("generate {A} --prompt hi --top-k -5", 1, "top_k must be"),
    ("generate {A} --prompt hi --top-p 2", 1, "top_p must be"),
    ("generate {A} --prompt hi --temperature -1", 1, "temperature must be"),
    ("generate {A} --prompt hi --max-tokens 0", 1, "max_tokens must be"),
    ("generate {A} --prompt hi --min-tokens 500", 1, "min_tokens must be"),
    ("generate {A} --prompt hi --top-logprobs 1000", 1, "top_logprobs must be"),
    ("generate {A} --prompt hi --logit-bias [1]", 1, "logit_bias: expected a JSON object"),
    ("generate {A} --prompt hi --logit-bias nope", 1, "logit_bias: expected a JSON object"),
    ('generate {A} --prompt hi --logit-bias {{"999999":1}}', 1, "logit_bias has token id 999999"),
    ("generate {A} --prompt hi --stop-token-ids 999999", 1, "stop_token_ids has token id 999999"),
    ("generate {A} --prompt hi --stop-token-ids -1", 1, "stop_token_ids must be"),
    # generate: serving flags
    ("generate {A} --prompt hi --max-num-batched-tokens 1 --max-num-seqs 4", 1, "max_num_batched_tokens (1)"),
    ("generate {A} --prompt hi --kv-cache-memory garbage", 2, "--kv-cache-memory"),
    ("generate {A} --prompt hi --kv-cache-memory 1", 1, "--kv-cache-memory 1:"),
    ("generate {A} --prompt hi --kv-cache-memory 100000G", 1, "lower --kv-cache-memory"),
    ("generate {A} --prompt hi --num-blocks 1", 1, "--num-blocks"),
    ("generate {A} --prompt hi --json-schema {B}", 1, "binary.txt: not UTF-8 text"),
    ("serve {A} --port 70000", 2, "--port: expected a TCP port, 1-65535, got '70000'"),
    ("serve {A} --max-n 0", 2, "--max-n must be >= 1"),
    ("generate {A} --prompt hi --max-context 0", 2, "--max-context must be >= 1"),
    ("generate {A} --prompt hi --threads -1", 2, "--threads must be >= 0"),
    ("generate {A} --prompt hi --threads 100000", 1, "--threads 100000:"),
    ("generate {A} --prompt hi --quant q4g32", 1, "--quant apply when compiling"),
    ("generate {C} --prompt hi --backend torch --block-size 3", 1, "--block-size 3: must be a power of two"),
    ("generate {A} --prompt hi --backend torch", 1, "--backend apply when compiling"),
    # generate: MODEL that is not one
    ("generate {O} --prompt hi", 1, "no such file or directory"),
    ("generate {D} --prompt hi", 1, "config.json: not found"),
    ("generate {F} --prompt hi", 1, "not a GGUF file"),
    ("generate {BAD_truncated} --prompt hi", 1, "tokenizer.json: not valid JSON"),
    ("chat {A} --n 2", 1, "n must be 1"),
    ("chat {A} --top-k -5", 1, "top_k must be"),
    # perplexity
    ("perplexity {C} --text {T} --window 64 --stride 128", 1, "--stride 128: stride must be in [1, window - 1 = 63]"),
    ("perplexity {C} --text {T} --window 64 --stride 64", 1, "--stride 64:"),
    ("perplexity {C} --text {T} --window 1", 1, "--window 1: a window needs at least 2 tokens"),
    ("perplexity {C} --text {T} --window 0", 2, "--window must be >= 1"),
    ("perplexity {A} --text {T} --window 64 --stride 128", 1, "--stride 128:"),
    ("perplexity {A} --text {T}", 1, "compile without last_token_logits"),
    ("perplexity {C} --text {O}", 1, "--text file not found"),
    ("perplexity {C} --text {B}", 1, "--text is not UTF-8 text"),
    ("perplexity {D} --text {T}", 1, "config.json: not found"),
    # compile
    ("compile {C} -o {T}", 1, "--output"),
    ("compile {C} -o {D}", 1, "not an llmlower artifact"),
    ("compile {C} -o {T}/sub", 1, "is not a directory"),
    ("compile {A} -o {O}", 1, "a compiled llmlower artifact, not a checkpoint"),
    ("compile {C} -o {O} --backend tvm --block-size 3", 1, "--block-size 3: must be a power of two"),
    ("compile {C} -o {O} --backend tvm --cpu nonsense", 1, "--cpu 'nonsense': not a CPU LLVM"),
    ("compile {C} -o {O} --backend onnx --cpu znver3", 1, "--cpu: one of the options of --backend tvm"),
    ("compile {C} -o {O} --target tpu", 1, "--target 'tpu'"),
    ("compile {C} -o {O} --backend mlir --dialect spirv", 1, "--dialect 'spirv': the mlir backend emits torch, linalg"),
    ("compile {C} -o {O} --dialect linalg", 1, "--dialect: one of the options of --backend mlir"),
    ("compile {C} -o {O} --backend mlir --static-dims seqs=2", 1, "--static-dims seqs=2: the step's dimensions are"),
    ("compile {C} -o {O} --backend mlir --static-dims tokens", 2, "--static-dims"),
    ("compile {C} -o {O} --backend mlir --target cuda", 1, "--target 'cuda': the mlir backend builds for cpu"),
    ("compile {C} -o {O} --quant q3", 1, "--quant 'q3'"),
    ("compile {C} -o {O} --passes nope", 1, "--passes: unknown pass 'nope'"),
    ("compile {C} -o {O} --accuracy-level 9", 2, "--accuracy-level"),
    ("compile {C} -o {O} --backend tvm --accuracy-level 1", 1, "--accuracy-level 1: the tvm backend takes 0"),
    ("compile {C} -o {O} --backend mlir --accuracy-level 4", 1, "--accuracy-level: one of the options of --backend"),
    ("compile {BAD_truncated} -o {O}", 1, "tokenizer.json: not valid JSON"),
    ("compile {BAD_notjson} -o {O}", 1, "tokenizer.json: not valid JSON"),
    ("compile {BAD_list} -o {O}", 1, "tokenizer.json: expected a JSON object"),
    ("compile {BAD_notatokenizer} -o {O}", 1, "tokenizer.json: not a tokenizer the tokenizers library reads"),
    # inspect, passes, roofline
    ("inspect {C} --context 0", 2, "--context must be >= 1"),
    ("inspect {C} --batch -1", 2, "--batch must be >= 1"),
    ("passes --explain nope", 1, "--explain: unknown pass 'nope'"),
    ("roofline {C} -o {O} --batch 0 --no-measure", 1, "--batch"),
    ("roofline {C} -o {O} --pipelines nope --no-measure", 1, "--pipelines"),
    ("roofline {C} -o {O} --machine tpu --no-measure", 1, "--machine 'tpu'"),
    ("roofline {A} -o {O} --no-measure", 1, "--checkpoint"),
]


@pytest.mark.parametrize(("command", "status", "message"), CASES)
def test_a_bad_invocation_is_one_line_naming_the_flag(paths, capsys, command, status, message):
    argv = [word.format(**paths) for word in command.split(" ")]
    try:
        code = main(argv)
    except SystemExit as exit:  # argparse's usage errors
        code = exit.code
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert code == status, err
    if status == 1:  # ours: exactly one "error:" line (progress lines of stages that finished may precede it)
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and err.rstrip().endswith(errors[0]), err
        assert message in errors[0]
    else:
        assert message in err
    assert not Path(paths["O"]).exists(), "a failed command wrote its output"


def test_compile_never_replaces_a_file_or_a_directory_that_is_not_an_artifact(paths, capsys):
    for target in (Path(paths["T"]), Path(paths["D"])):
        before = sorted(p.name for p in target.parent.iterdir())
        assert main(["compile", paths["C"], "-o", str(target)]) == 1
        assert f"--output {target}" in capsys.readouterr().err
        assert sorted(p.name for p in target.parent.iterdir()) == before  # no staging or .old directory left
    assert Path(paths["T"]).read_text(encoding="utf-8") == TEXT
    assert (Path(paths["D"]) / "readme.md").read_text() == "not a model"


@torch.library.custom_op("llmlower_cli_test::wobble", mutates_args=())
def _wobble(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(x)


@_wobble.register_fake
def _wobble_fake(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class Wobble(torch.nn.Module):
    """An activation function no backend lowers: a custom op of the test's own."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.llmlower_cli_test.wobble(x)


@pytest.fixture()
def wobbly_llama(tiny_llama, tmp_path, monkeypatch) -> Path:
    """The tiny Llama with hidden_act "wobble": its MLPs call the custom op, and the captured program with it."""
    monkeypatch.setitem(ACT2FN, "wobble", Wobble)
    checkpoint = shutil.copytree(tiny_llama, tmp_path / "wobbly-llama")
    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**config, "hidden_act": "wobble"}))
    return checkpoint


@pytest.mark.parametrize("backend", ["onnx", "tvm", "mlir"])
def test_an_op_no_backend_lowers_is_one_line_naming_node_op_and_backend(backend, wobbly_llama, tmp_path, capsys):
    """Wherever the backend finds it (its own check, or its toolkit's exception at the backend boundary: torch.onnx's
    "No ONNX function found"), the op is named in one line, without a traceback, and nothing is written."""
    out = tmp_path / "out"
    assert main(["compile", str(wobbly_llama), "-o", str(out), "--backend", backend, "--recipe", "exact"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and err.rstrip().endswith(errors[0]), err
    named = rf"error: the {backend} backend cannot lower node wobble\w* \(op llmlower_cli_test\.wobble\.default\)"
    assert re.match(named, errors[0], re.IGNORECASE), errors[0]
    assert not out.exists()
