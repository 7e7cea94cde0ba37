"""draft_layers and `compile --draft-layers`: the early-exit self-draft for speculative decoding.

The draft keeps the target's first K decoder layers, its final norm and LM head; its reference is transformers'
own model loaded from the same checkpoint with num_hidden_layers=K (which drops the later layers' weights).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers

from llmlower.api import check_draft_layers, draft_pipeline
from llmlower.cli import build_parser, main
from llmlower.errors import ArgumentError, PassError
from llmlower.frontend import capture, load
from llmlower.passes import run_pipeline
from llmlower.runtime import Engine
from llmlower.runtime.artifact import MANIFEST, ArtifactError, draft_artifact, read_manifest
from llmlower.step_io import cache_names
from llmlower.testing import layer_types_settable

LAYERS = 3


@pytest.fixture(scope="module")
def three_layer(tmp_path_factory, tiny_checkpoint_writer):
    """arch -> a loaded 3-layer tiny checkpoint (built and loaded once per arch)."""
    root = tmp_path_factory.mktemp("three-layer")
    loaded = {}

    def get(arch: str):
        if arch not in loaded:
            loaded[arch] = load(tiny_checkpoint_writer(arch, root / arch, num_hidden_layers=LAYERS))
        return loaded[arch]

    return get


def _transformers_logits(loaded, layers: int, ids: torch.Tensor) -> torch.Tensor:
    """Logits of transformers' own model from the same checkpoint, built with `layers` decoder layers."""
    types = loaded.spec.layer_types
    settable = layer_types_settable(loaded.module.config)
    options = {"layer_types": list(types[:layers])} if types and settable else {}
    model = transformers.AutoModelForCausalLM.from_pretrained(loaded.source, num_hidden_layers=layers, **options)
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    with torch.no_grad():
        return model.eval()(input_ids=ids, position_ids=positions).logits


PROMPTS = torch.randint(5, 320, (2, 9), generator=torch.Generator().manual_seed(3))


def test_draft_equals_transformers_with_k_layers(three_layer, tiny_arch):
    loaded = three_layer(tiny_arch)
    # two layers: a hybrid's first layer alone may have no attention, which transformers' own model cannot run
    program = run_pipeline(capture(loaded), draft_pipeline(["canonicalize", "eager_attention"], 2))
    positions = torch.arange(PROMPTS.shape[1]).expand_as(PROMPTS)
    logits = program(input_ids=PROMPTS, position_ids=positions)["logits"]  # every position
    torch.testing.assert_close(logits, _transformers_logits(loaded, 2, PROMPTS), rtol=1e-5, atol=1e-5)
    assert program.spec.num_layers == 2
    stats = next(record.stats for record in program.history if record.name == "draft_layers")
    assert (stats["layers_kept"], stats["layers_dropped"]) == (2, LAYERS - 2)
    assert stats["parameters"] < stats["parameters_before"]


def test_after_kv_cache_the_dropped_layers_caches_leave_the_signature(three_layer):
    """draft_layers also runs after kv_cache (its attention nodes belong to their layers); --verify compares with
    the program before the pass run with the same early exit."""
    loaded = three_layer("llama")
    program = run_pipeline(capture(loaded), ["canonicalize", "kv_cache", ("draft_layers", {"layers": 2})], verify=True)
    caches = [name for layer in range(2) for name in cache_names(layer)]
    assert program.input_names == ["input_ids", "position_ids", "past_lens", "input_lens", *caches]
    assert program.output_names == ["logits", *caches]
    assert program.history[-1].max_error == 0.0
    assert program.history[-1].stats["cache_inputs_dropped"] == 2
    empty = {name: torch.zeros(2, 2, 16, 16) for name in caches}
    lens = torch.tensor([9, 9])
    positions = torch.arange(9).expand(2, 9)
    outputs = program(input_ids=PROMPTS, position_ids=positions, past_lens=lens * 0, input_lens=lens, **empty)
    torch.testing.assert_close(outputs["logits"], _transformers_logits(loaded, 2, PROMPTS), rtol=1e-5, atol=1e-5)


def test_refuses_layer_counts_out_of_range(three_layer):
    captured = capture(three_layer("llama"))  # refused before the graph is touched
    for layers in (0, LAYERS, None):
        with pytest.raises(PassError, match=r"layers") as error:
            run_pipeline(captured, [("draft_layers", {"layers": layers})])
        if layers is not None:
            assert f"{LAYERS} decoder layers" in str(error.value)


def test_refuses_a_program_whose_layers_fusions_merged(three_layer):
    """fuse_norms merges each residual add with the next layer's norm: no boundary left to cut at."""
    with pytest.raises(PassError, match="draft_layers first"):
        run_pipeline(capture(three_layer("llama")), ["canonicalize", "fuse_norms", ("draft_layers", {"layers": 1})])


# compile --draft-layers: the target artifact with its self-draft inside


@pytest.fixture(scope="module")
def with_draft(tiny_llama, compiled):
    """The 2-layer tiny llama compiled with the ONNX backend and a 1-layer self-draft."""
    return compiled(tiny_llama, draft_layers=1)


def test_compile_writes_the_draft_inside_the_target(with_draft):
    manifest = read_manifest(with_draft)  # every file hashed, the draft's included
    entry = manifest["drafts"]["layers-1"]
    assert (entry["path"], entry["file"], entry["layers"]) == ("draft-layers-1", "draft-layers-1/manifest.json", 1)
    assert entry["manifest_sha256"] == manifest["files"]["draft-layers-1/manifest.json"]
    assert "draft-layers-1/model.onnx.data" in manifest["files"]
    draft = draft_artifact(with_draft, 1, verify=True)
    assert draft == with_draft / "draft-layers-1"
    own = read_manifest(draft)
    assert own["spec"]["num_layers"] == 1 and manifest["spec"]["num_layers"] == 2
    assert own["draft"] == {"method": "early_exit", "layers": 1, "target_layers": 2}
    target = [step["name"] for step in manifest["pipeline"]]
    expected = [step if isinstance(step, str) else step[0] for step in draft_pipeline(target, 1)]
    assert [step["name"] for step in own["pipeline"]] == expected
    assert expected.index("draft_layers") == expected.index("eager_attention") + 1  # before the fusions
    assert {k: v for k, v in own["kv_layout"].items() if k != "layers"} == {
        k: v for k, v in manifest["kv_layout"].items() if k != "layers"
    }
    assert (own["backend"], own["target"], own["dtype"]) == (manifest["backend"], manifest["target"], "float32")
    scratch = [p.name for p in with_draft.parent.iterdir() if p.name.startswith(".") and with_draft.name in p.name]
    assert not scratch  # no scratch of this compile left (other workers may be compiling beside it)


def test_both_artifacts_load(with_draft):
    target = Engine.load(with_draft)
    draft = Engine.load(draft_artifact(with_draft, 1))
    assert (target.spec.num_layers, draft.spec.num_layers) == (2, 1)


def test_draft_artifact_names_the_drafts_it_has(with_draft):
    with pytest.raises(ArtifactError, match=r"self-drafts of 1 decoder layers.*--draft-layers 3"):
        draft_artifact(with_draft, 3)


def test_a_tampered_draft_is_refused(with_draft, tmp_path):
    copy = shutil.copytree(with_draft, tmp_path / "copy")
    weights = copy / "draft-layers-1" / "model.onnx.data"
    data = bytearray(weights.read_bytes())
    data[100] ^= 0xFF
    weights.write_bytes(bytes(data))
    for path in (copy, draft_artifact(copy, 1)):  # the target's hashes cover the draft's files too
        with pytest.raises(ArtifactError, match="sha256 does not match"):
            Engine.load(path)


def test_a_draft_manifest_other_than_recorded_is_refused(with_draft, tmp_path):
    copy = shutil.copytree(with_draft, tmp_path / "copy")
    own = copy / "draft-layers-1" / MANIFEST
    own.write_text(own.read_text() + "\n")
    with pytest.raises(ArtifactError, match="sha256 does not match"):
        draft_artifact(copy, 1)


def test_a_draft_path_leaving_the_artifact_is_refused(with_draft, tmp_path):
    copy = shutil.copytree(with_draft, tmp_path / "copy")
    path = copy / MANIFEST
    manifest = json.loads(path.read_text())
    manifest["drafts"]["layers-1"]["path"] = "../elsewhere"
    path.write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match=r"leaves the artifact directory"):
        draft_artifact(copy, 1)


@pytest.mark.parametrize(("layers", "stage"), [("2", "capture"), ("0", "load")])
def test_out_of_range_draft_layers_are_refused_before_compiling(tiny_llama, tmp_path, capsys, layers, stage):
    """K >= the model's layers is refused once its config is loaded, K < 1 before; nothing is written."""
    out = tmp_path / "out"
    assert main(["compile", str(tiny_llama), "-o", str(out), "--draft-layers", layers]) == 1
    err = capsys.readouterr().err
    assert f"--draft-layers {layers}" in err and stage not in err
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_draft_layers_is_repeatable():
    args = build_parser().parse_args(["compile", "m", "-o", "o", "--draft-layers", "2", "--draft-layers", "1"])
    assert args.draft_layers == [2, 1]
    assert check_draft_layers([2, 1, 2], 4) == [1, 2]
    with pytest.raises(ArgumentError, match="--draft-layers 4"):
        check_draft_layers(4, 4)


def test_explain(capsys):
    assert main(["passes", "--explain", "draft_layers"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("draft_layers") and "early exit" in out.replace("-", " ")
