"""`generate MODEL` and `chat MODEL` compile MODEL once into $LLMLOWER_CACHE/artifacts and reuse it: the second run
compiles nothing, another --quant is another entry, a damaged file or a new toolkit compiles again in place, two
callers at once compile once, --backend torch and bad flags write nothing.

One entry (the tiny Llama, the auto recipe for ONNX Runtime) is compiled once per module; tests start from a copy of
it."""

from __future__ import annotations

import io
import json
import shutil
import threading
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

from llmlower import compile_cache
from llmlower.cli import main
from llmlower.compile_cache import CompileRequest, load_compiled
from llmlower.passes import build_pipeline
from llmlower.recipes import pick_auto
from llmlower.runtime.artifact import read_manifest

ARGS = ["--prompt", "Hello there", "--max-tokens", "8", "--json", "--backend", "onnx"]


def generate(model: Path, capsys: pytest.CaptureFixture, *flags: str) -> tuple[dict, str]:
    """The --json result and stderr of `llmlower generate MODEL ... FLAGS`."""
    assert main(["generate", str(model), *ARGS, *flags]) == 0
    captured = capsys.readouterr()
    return json.loads(captured.out), captured.err


def entries(cache: Path) -> list[Path]:
    return sorted(p for p in (cache / "artifacts").iterdir() if p.is_dir())


@pytest.fixture(scope="module")
def first_run(tiny_llama, tmp_path_factory) -> tuple[Path, dict, str]:
    """A cache in which `generate tiny_llama` compiled its entry: (the cache, the result, stderr)."""
    cache = tmp_path_factory.mktemp("template") / "cache"
    stdout, stderr = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as patch, redirect_stdout(stdout), redirect_stderr(stderr):
        patch.setenv("LLMLOWER_CACHE", str(cache))
        assert main(["generate", str(tiny_llama), *ARGS]) == 0
    return cache, json.loads(stdout.getvalue()), stderr.getvalue()


@pytest.fixture()
def cache(first_run, tmp_path, monkeypatch) -> Path:
    """A copy of the first run's cache (file times kept) as $LLMLOWER_CACHE."""
    copy = shutil.copytree(first_run[0], tmp_path / "cache")
    monkeypatch.setenv("LLMLOWER_CACHE", str(copy))
    return copy


def test_the_first_run_compiles_the_auto_recipe_and_says_where(first_run, tiny_llama):
    cache, result, err = first_run
    [entry] = entries(cache)
    recipe, _ = pick_auto("onnx")
    assert f"recipe auto -> {recipe.name}: " in err
    assert f"compiling {tiny_llama} with {recipe.quant} for onnx/cpu once, cached at {entry}" in err
    assert "lower to ONNX" in err  # the compile's own progress follows
    manifest = read_manifest(entry)
    assert (manifest["backend"], manifest["target"]) == ("onnx", "cpu")
    assert manifest["pipeline"][-1]["name"] == ("gptq" if recipe.gptq else "quantize_weights")
    assert (manifest["recipe"]["asked"], manifest["recipe"]["recipe"]) == ("auto", recipe.name)
    key = json.loads((entry / "cache_key.json").read_text())
    assert key["model"] == str(tiny_llama.resolve())
    assert set(key["model_files"]) >= {"config.json", "model.safetensors", "tokenizer.json"}
    assert {"llmlower", "compiler_source", "onnx"} <= set(key["toolkit"])
    assert len(result["token_ids"]) == 8


def test_the_second_run_reuses_the_entry(first_run, cache, tiny_llama, capsys):
    [entry] = entries(cache)
    before = {p.name: p.stat().st_mtime_ns for p in entry.iterdir()}
    result, err = generate(tiny_llama, capsys)
    assert "compiling" not in err and "lower to ONNX" not in err
    assert {p.name: p.stat().st_mtime_ns for p in entry.iterdir()} == before
    assert result["token_ids"] == first_run[1]["token_ids"]


def test_another_quant_is_another_entry_and_agrees_with_the_reference(cache, tiny_llama, capsys):
    compiled, err = generate(tiny_llama, capsys, "--quant", "none")
    assert "with unquantized weights for onnx/cpu once" in err
    assert len(entries(cache)) == 2
    reference, err = generate(tiny_llama, capsys, "--backend", "torch")  # the reference: no entry, no compiling
    assert "compiling" not in err and len(entries(cache)) == 2
    assert compiled["token_ids"] == reference["token_ids"]
    assert compiled["prompt_token_ids"] == reference["prompt_token_ids"]


def test_a_damaged_entry_is_compiled_again_and_leftovers_removed(first_run, cache, tiny_llama, capsys):
    [entry] = entries(cache)
    weights = entry / "model.onnx.data"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    killed = entry.with_name(f".{entry.name}.x1y2z3")  # the staging directory of a compile killed half-way
    killed.mkdir()
    (killed / "model.onnx").write_bytes(b"\x08")
    result, err = generate(tiny_llama, capsys)
    assert "again (damaged:" in err and "model.onnx.data: sha256 does not match" in err
    assert entries(cache) == [entry] and not killed.exists()
    read_manifest(entry, verify=True)
    assert result["token_ids"] == first_run[1]["token_ids"]


def test_a_new_toolkit_compiles_again_in_place(cache, tiny_llama, capsys, monkeypatch):
    [entry] = entries(cache)
    monkeypatch.setattr(compile_cache, "__version__", "99.0")
    _, err = generate(tiny_llama, capsys)
    assert "again (toolkit changed)" in err
    assert entries(cache) == [entry]
    assert json.loads((entry / "cache_key.json").read_text())["toolkit"]["llmlower"] == "99.0"


def test_chat_runs_the_cached_entry(cache, tiny_llama, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n/exit\n"))
    assert main(["chat", str(tiny_llama), "--max-tokens", "4", "--backend", "onnx"]) == 0
    captured = capsys.readouterr()
    assert captured.out.count("> ") == 2 and "compiling" not in captured.err


def test_two_callers_at_once_compile_once(tiny_llama, tmp_path, monkeypatch):
    """flock locks belong to open file descriptions, so two threads contend for an entry as two processes do."""
    monkeypatch.setenv("LLMLOWER_CACHE", str(tmp_path / "cache"))
    request = CompileRequest(tuple(build_pipeline(quant="q8")), "q8", "onnx")
    messages: list[str] = []
    manifests: list[dict] = []
    start = threading.Barrier(2)

    def run() -> None:
        start.wait()
        manifests.append(load_compiled(tiny_llama, request, read_manifest, notify=messages.append))

    threads = [threading.Thread(target=run) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(manifests) == 2 and manifests[0] == manifests[1]
    assert sum(message.startswith("compiling") for message in messages) == 1, messages


def test_bad_input_writes_nothing(tiny_llama, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LLMLOWER_CACHE", str(tmp_path / "cache"))
    assert main(["generate", str(tiny_llama), "--prompt", "x", "--quant", "q5"]) == 1
    assert main(["generate", str(tmp_path / "missing"), "--prompt", "x"]) == 1
    err = capsys.readouterr().err
    assert "--quant 'q5'" in err and "missing: no such file or directory" in err
    assert not (tmp_path / "cache").exists()


def test_a_self_draft_speculation_compiles_an_entry_with_the_draft(cache, tiny_llama, capsys):
    result, _ = generate(tiny_llama, capsys, "--speculative", "self:1", "--temperature", "0")
    drafted = [entry for entry in entries(cache) if "drafts" in read_manifest(entry)]
    assert len(drafted) == 1 and len(entries(cache)) == 2  # another entry beside the plain one
    assert result["speculation"]["drafts"] >= 1
    again, err = generate(tiny_llama, capsys, "--speculative", "self:1", "--temperature", "0")
    assert "compiling" not in err and again["token_ids"] == result["token_ids"]
