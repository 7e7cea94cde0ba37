"""Recipes: `auto` picks the fastest recipe inside the quality gate for the CPU's features and the backends installed,
explicit flags win over a recipe's settings, the choice is printed once and recorded in the manifest and `inspect`,
and calibrated passes' results are kept so a second compile skips calibration."""

from __future__ import annotations

import json

import pytest
import torch

from llmlower import compile_model, load_model
from llmlower.api import CALIBRATION_DIR, compile_program
from llmlower.cli import main
from llmlower.errors import ArgumentError
from llmlower.passes import build_pipeline
from llmlower.recipes import QUALITY_GATE, RECIPES, Recipe, choose, pick_auto
from llmlower.runtime import SamplingParams
from llmlower.runtime.artifact import read_manifest

EVERY_BACKEND = {"onnx", "tvm", "mlir", "torch"}
AVX512 = {"avx2", "avx512f", "avx512_vnni", "avx512_bf16"}
ARM = {"asimd", "asimddp", "i8mm"}


def test_every_recipe_names_settings_its_backend_takes():
    for recipe in RECIPES.values():
        assert recipe.backend in EVERY_BACKEND
        build_pipeline(None, recipe.quant, gptq=recipe.gptq, awq=recipe.awq, scale_dtype=recipe.scale_dtype)
        assert set(recipe.quality) <= {"heldout", "unseen"}
    assert list(RECIPES)[-1] == "exact" and not RECIPES["exact"].quality


@pytest.mark.parametrize(
    ("flags", "installed", "backend"),
    [
        (AVX512, EVERY_BACKEND, None),
        ({"avx2"}, EVERY_BACKEND, None),
        (ARM, EVERY_BACKEND, None),
        (AVX512, {"onnx", "torch"}, None),
        (None, EVERY_BACKEND, None),
        (AVX512, EVERY_BACKEND, "onnx"),
        (AVX512, EVERY_BACKEND, "tvm"),
    ],
)
def test_auto_is_the_first_recipe_this_machine_runs_well_inside_the_gate(flags, installed, backend):
    recipe, reason = pick_auto(backend, flags, installed)
    candidates = [
        r
        for r in RECIPES.values()
        if r.backend in installed
        and (backend is None or r.backend == backend)
        and r.runs_well_on(flags)
        and r.worst_quality <= QUALITY_GATE
    ]
    assert recipe == candidates[0]
    for skipped in list(RECIPES.values())[: list(RECIPES.values()).index(recipe)]:
        if backend is None or skipped.backend == backend:
            assert skipped.name in reason  # each faster recipe passed over is named, with why


def test_auto_never_picks_a_recipe_outside_the_gate_or_for_another_cpu():
    outside = Recipe("sloppy", "int2", "onnx", quant="q4g32", quality={"heldout": QUALITY_GATE + 1})
    assert not Recipe("x", "", "tvm", machines=(frozenset({"avx2"}),)).runs_well_on(ARM)
    assert Recipe("x", "", "tvm", machines=(frozenset({"avx2"}),)).runs_well_on(AVX512)
    assert not Recipe("x", "", "tvm", machines=(frozenset({"avx2"}),)).runs_well_on(None)
    assert outside.worst_quality > QUALITY_GATE  # pick_auto's check; RECIPES holds no such recipe in front of exact
    recipe, _ = pick_auto(None, set(), {"onnx"})
    assert recipe.backend == "onnx" and recipe.worst_quality <= QUALITY_GATE


def test_a_backend_no_recipe_is_measured_on_compiles_unquantized():
    recipe, reason = pick_auto("torch", AVX512, EVERY_BACKEND)
    assert (recipe.backend, recipe.quant) == ("torch", "none") and "no recipe is measured on torch" in reason
    recipe, reason = pick_auto("tvm", ARM, EVERY_BACKEND)  # TVM's recipes need x86: unquantized, saying why
    assert (recipe.backend, recipe.quant) == ("tvm", "none") and "no tvm recipe runs here" in reason
    assert "fast needs a CPU with avx2" in reason


def test_explicit_settings_win_and_a_quant_replaces_the_recipes_quantization():
    fast = next(r for r in RECIPES.values() if r.gptq)
    choice = choose(fast.name, {"kv_cache_dtype": "int8"})
    assert choice.settings == {**fast.settings, "kv_cache_dtype": "int8"}
    assert choice.overridden == ("kv_cache_dtype",) and "--kv-cache-dtype" in choice.reason
    choice = choose(fast.name, {"quant": "q8", "backend": None, "gptq": False})
    assert choice.settings["quant"] == "q8" and not choice.settings["gptq"] and choice.settings["scale_dtype"] is None
    assert choice.settings["backend"] == fast.backend
    with pytest.raises(ArgumentError, match="--recipe 'fastest': one of auto, "):
        choose("fastest", {})
    with pytest.raises(Exception, match="--backend 'tpu'"):
        choose("exact", {"backend": "tpu"})


def test_compile_records_the_recipe_in_the_manifest_and_inspect_shows_it(tiny_llama, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["compile", str(tiny_llama), "-o", str(out), "--recipe", "exact", "--kv-cache-dtype", "int8"]) == 0
    err = capsys.readouterr().err
    assert err.count("recipe exact: ") == 1 and "given explicitly: --kv-cache-dtype" in err
    assert "compiled in " in err and "calibration" in err  # the int8 cache's scales are calibrated
    recipe = read_manifest(out)["recipe"]
    assert (recipe["asked"], recipe["recipe"], recipe["overridden"]) == ("exact", "exact", ["kv_cache_dtype"])
    assert recipe["settings"]["kv_cache_dtype"] == "int8" and recipe["settings"]["backend"] == "onnx"
    assert main(["inspect", str(out), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["recipe"] == recipe and shown["backend"] == "onnx" and "kv_cache_dtype" in shown["pipeline"]
    assert main(["inspect", str(out)]) == 0
    assert "recipe: exact" in capsys.readouterr().out


def test_the_python_api_compiles_and_loads_by_recipe(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setenv("LLMLOWER_CACHE", str(tmp_path / "cache"))
    out = compile_model(tiny_llama, tmp_path / "portable", recipe="portable", quant="q8")
    recipe = read_manifest(out)["recipe"]
    assert (recipe["recipe"], recipe["settings"]["quant"], recipe["settings"]["gptq"]) == ("portable", "q8", False)
    lines: list[str] = []
    greedy = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0)
    [result] = load_model(tiny_llama, "exact", notify=lines.append).generate(["Hello"], greedy)
    assert len(result.token_ids) == 4 and lines[0].startswith("recipe exact: ") and "compiling" in lines[1]
    [again] = load_model(tiny_llama, "exact", notify=lines.append).generate(["Hello"], greedy)
    assert again.token_ids == result.token_ids
    assert sum("compiling" in line for line in lines) == 1


def test_calibration_is_kept_and_a_second_compile_reads_it(tiny_llama, tmp_path, monkeypatch):
    """gptq and smoothquant (q4mix-a8) on the same program twice: the second run reads the first's results from the
    cache directory's store and rewrites the program identically; a damaged file is computed again."""
    monkeypatch.setenv("LLMLOWER_CACHE", str(tmp_path))
    pipeline = build_pipeline(None, "q4mix-a8", gptq=True)
    store = tmp_path / CALIBRATION_DIR

    def compiled() -> dict[str, torch.Tensor]:
        _, program = compile_program(tiny_llama, pipeline)
        assert program.history[-1].stats["calibration_tokens"] > 0
        return dict(program.graph_module.state_dict())

    first = compiled()
    files = sorted(store.iterdir())
    assert [f.name.split("-")[0] for f in files] == ["gptq", "smoothquant"]
    stamps = [f.stat().st_mtime_ns for f in files]
    second = compiled()
    assert [f.stat().st_mtime_ns for f in files] == stamps  # read, not written again
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    files[0].write_bytes(b"not safetensors")
    third = compiled()
    assert all(torch.equal(first[k], third[k]) for k in first)
    assert files[0].stat().st_size > len(b"not safetensors")
