"""Artifacts: `llmlower compile` writes a hashed, self-describing directory that runs without torch."""

from __future__ import annotations

import json

import pytest

from llmlower.cli import main
from llmlower.runtime import Engine
from llmlower.runtime.artifact import FORMAT_VERSION, ArtifactError, write_artifact
from llmlower.runtime.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def artifact(tiny_llama, compiled):
    return compiled(tiny_llama)


def test_manifest_describes_the_artifact(artifact):
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert manifest["format_version"] == FORMAT_VERSION
    assert (manifest["backend"], manifest["target"], manifest["dtype"]) == ("onnx", "cpu", "float32")
    assert manifest["executor"] == "onnx:OnnxSlotExecutor"  # what runs it, found without the backends table
    assert manifest["spec"]["num_kv_heads"] == 2
    assert [p["name"] for p in manifest["pipeline"]][-3:] == ["kv_cache", "fuse_qkv_attention", "last_token_logits"]
    assert manifest["kv_layout"]["kind"] == "slots"  # GroupQueryAttention's per-sequence caches on the CPU
    assert manifest["kv_layout"]["shape"] == ["slots", "kv_heads", "context", "head_dim"]
    step = manifest["entry_points"]["step"]
    assert [t["name"] for t in step["inputs"]][:4] == ["input_ids", "position_ids", "past_lens", "input_lens"]
    files = {"model.onnx", "model.onnx.data", "tokenizer.json", "tokenizer_config.json", "generation_config.json"}
    assert set(manifest["files"]) == files
    assert all(len(digest) == 64 for digest in manifest["files"].values())


def test_generate_runs_an_artifact_as_it_runs_the_checkpoint(artifact, tiny_llama, capsys):
    args = ["--prompt", "Hello there", "--max-tokens", "8", "--json"]
    assert main(["generate", str(artifact), *args]) == 0
    from_artifact = json.loads(capsys.readouterr().out)
    assert main(["generate", str(tiny_llama), *args, "--backend", "torch"]) == 0
    from_checkpoint = json.loads(capsys.readouterr().out)
    assert from_artifact["token_ids"] == from_checkpoint["token_ids"]
    assert from_artifact["prompt_token_ids"] == from_checkpoint["prompt_token_ids"]


def test_engine_load_needs_neither_torch_nor_transformers(artifact, without_torch):
    expected = (
        Engine.load(artifact)
        .generate(["The quick brown fox"], SamplingParams(temperature=0, max_tokens=6), chat=False)[0]
        .token_ids
    )
    done = without_torch(
        f"""
        from llmlower.runtime import Engine, SamplingParams
        engine = Engine.load({str(artifact)!r})
        params = SamplingParams(temperature=0, max_tokens=6)
        print(engine.generate(["The quick brown fox"], params, chat=False)[0].token_ids)
        import sys
        assert not [m for m in sys.modules if m.startswith("llmlower.backends")]  # the manifest names the executor
        """
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(expected)


def test_a_corrupted_file_is_named(artifact, tmp_path, capsys):
    import shutil

    copy = shutil.copytree(artifact, tmp_path / "copy")
    weights = copy / "model.onnx.data"
    data = bytearray(weights.read_bytes())
    data[100] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match=r"model\.onnx\.data: sha256 does not match"):
        Engine.load(copy)
    assert main(["generate", str(copy), "--prompt", "x"]) != 0
    err = capsys.readouterr().err
    assert "model.onnx.data" in err and "Traceback" not in err


def test_another_format_version_is_refused(artifact, tmp_path):
    import shutil

    copy = shutil.copytree(artifact, tmp_path / "copy")
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["format_version"] = FORMAT_VERSION + 1
    (copy / "manifest.json").write_text(json.dumps(manifest))
    expected = f"format_version {FORMAT_VERSION + 1}; this llmlower reads version {FORMAT_VERSION}"
    with pytest.raises(ArtifactError, match=expected):
        Engine.load(copy)


def test_a_missing_file_is_named(artifact, tmp_path, capsys):
    import shutil

    copy = shutil.copytree(artifact, tmp_path / "copy")
    (copy / "tokenizer.json").unlink()
    with pytest.raises(ArtifactError, match=r"tokenizer\.json: listed in manifest\.json but missing"):
        Engine.load(copy)
    assert main(["generate", str(copy), "--prompt", "x"]) != 0
    assert "tokenizer.json" in capsys.readouterr().err


def test_an_unsupported_target_is_refused_before_compiling(tiny_llama, tmp_path, capsys):
    assert main(["compile", str(tiny_llama), "-o", str(tmp_path / "out"), "--target", "tpu"]) == 1
    err = capsys.readouterr().err
    assert "--target 'tpu'" in err and "cpu, cuda" in err and "capture" not in err
    assert list(tmp_path.iterdir()) == []


def test_an_interrupted_write_leaves_the_previous_artifact(artifact, tmp_path):
    """Ctrl-C while the files are written: no half-written directory, an existing artifact untouched."""
    import shutil

    previous = shutil.copytree(artifact, tmp_path / "artifact")
    before = json.loads((previous / "manifest.json").read_text())

    def write_then_interrupt(staging):
        (staging / "model.onnx").write_bytes(b"partial")
        raise KeyboardInterrupt

    for target in (tmp_path / "fresh", previous):
        with pytest.raises(KeyboardInterrupt):
            write_artifact(target, write_then_interrupt, {"backend": "onnx"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["artifact"]
    assert json.loads((previous / "manifest.json").read_text()) == before
    Engine.load(previous)  # still whole: every hash checks out


def test_a_replace_interrupted_before_is_no_obstacle(artifact, tmp_path):
    """A `.NAME.old` left by a replace that was killed between its renames does not stop the next one."""
    import shutil

    previous = shutil.copytree(artifact, tmp_path / "artifact")
    (tmp_path / ".artifact.old").mkdir()
    (tmp_path / ".artifact.old" / "model.onnx").write_bytes(b"stale")
    write_artifact(
        previous, lambda staging: shutil.copytree(artifact, staging, dirs_exist_ok=True), {"backend": "onnx"}
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["artifact"]


def test_a_failed_compile_leaves_nothing_behind(tiny_checkpoints, tmp_path, capsys):
    out = tmp_path / "gpt2-artifact"
    args = ["compile", str(tiny_checkpoints["gpt2"]), "-o", str(out), "--backend", "onnx", "--quant", "q8"]
    args.append("--quant-embedding")
    assert main(args) != 0  # qembedding has no ONNX lowering yet
    assert "cannot lower node" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_pipeline_options_on_an_artifact_are_refused(artifact, capsys):
    assert main(["generate", str(artifact), "--prompt", "x", "--quant", "q4g32"]) == 1
    assert "is a compiled artifact: --quant apply when compiling" in capsys.readouterr().err


def _tampered(artifact, tmp_path, change):
    """A copy of the artifact whose manifest `change(manifest, copy)` edited (manifest.json is not hashed)."""
    import shutil

    copy = shutil.copytree(artifact, tmp_path / "copy")
    manifest = json.loads((copy / "manifest.json").read_text())
    change(manifest, copy)
    (copy / "manifest.json").write_text(json.dumps(manifest))
    return copy


def _point_step_at(name):
    def change(manifest, copy):
        manifest["entry_points"]["step"]["file"] = name

    return change


def _symlink_out(manifest, copy):
    """A hashed file that is a symlink to a file outside the artifact."""
    from llmlower.runtime.artifact import sha256

    outside = copy.parent / "outside.onnx"
    outside.write_bytes((copy / "model.onnx").read_bytes())
    (copy / "linked.onnx").symlink_to(outside)
    manifest["files"]["linked.onnx"] = sha256(outside)
    manifest["entry_points"]["step"]["file"] = "linked.onnx"


def _unlisted(manifest, copy):
    (copy / "other.onnx").write_bytes((copy / "model.onnx").read_bytes())
    manifest["entry_points"]["step"]["file"] = "other.onnx"


def _listed_outside(manifest, copy):
    manifest["files"]["../outside.bin"] = "0" * 64


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (_point_step_at("../model.onnx"), r"entry_points\.step\.file '\.\./model\.onnx': leaves the artifact"),
        (_point_step_at("/etc/hostname"), r"entry_points\.step\.file '/etc/hostname': an absolute path"),
        (_point_step_at(42), r"entry_points\.step\.file 42: expected a file name"),
        (_symlink_out, r"files\['linked\.onnx'\] 'linked\.onnx': resolves to .*outside\.onnx, outside .*symlink"),
        (_unlisted, r"entry_points\.step\.file 'other\.onnx' is not in the manifest's files \(not hashed\)"),
        (_listed_outside, r"files\['\.\./outside\.bin'\] '\.\./outside\.bin': leaves the artifact"),
    ],
    ids=["dotdot", "absolute", "not-a-name", "symlink-out", "unhashed", "files-dotdot"],
)
def test_every_path_the_manifest_names_stays_inside_and_is_hashed(artifact, tmp_path, capsys, change, message):
    copy = _tampered(artifact, tmp_path, change)
    with pytest.raises(ArtifactError, match=message):
        Engine.load(copy)
    assert main(["generate", str(copy), "--prompt", "x"]) == 1
    err = capsys.readouterr().err
    assert "manifest.json" in err and "Traceback" not in err


@pytest.mark.parametrize("field", ["spec", "dtype", "kv_layout", "target", "backend", "executor", "spec.vocab_size"])
def test_a_manifest_missing_a_field_is_one_line_naming_it(artifact, tmp_path, capsys, field):
    def drop(manifest, _):
        *parents, name = field.split(".")
        owner = manifest[parents[0]] if parents else manifest
        del owner[name]

    copy = _tampered(artifact, tmp_path, drop)
    assert main(["generate", str(copy), "--prompt", "x"]) == 1
    err = capsys.readouterr().err
    assert f"manifest.json: field '{field.split('.')[0]}'" in err and "Traceback" not in err
    if "." in field:
        assert field.split(".")[1] in err


@pytest.mark.parametrize(
    ("executor", "message"),
    [
        ("os:system", r"expected \"module:Class\" with the module one of llmlower\.runtime\.executors: mlir, onnx"),
        ("..artifact:ArtifactError", r"expected \"module:Class\""),
        ("onnx", r"expected \"module:Class\""),
        ("onnx:os", r"onnx has no executor 'os'"),
        ("onnx:Executor", r"onnx has no executor 'Executor'"),  # imported there, not one of its executors
        ("onnx:SlotExecutor", r"onnx has no executor 'SlotExecutor'"),
    ],
    ids=["other-package", "relative", "no-class", "not-a-class", "base-class", "abstract"],
)
def test_the_executor_a_manifest_names_is_checked_before_it_runs(artifact, tmp_path, capsys, executor, message):
    def name_executor(manifest, _):
        manifest["executor"] = executor

    copy = _tampered(artifact, tmp_path, name_executor)
    with pytest.raises(ArtifactError, match=r"manifest\.json: field 'executor' .*" + message):
        Engine.load(copy)
    assert main(["generate", str(copy), "--prompt", "x"]) == 1
    assert "field 'executor'" in capsys.readouterr().err


def test_every_file_field_is_checked(tmp_path):
    """Each backend's `file` fields (TVM's weights and device code, ONNX's copy model) are found by one walk."""
    from llmlower.runtime.artifact import named_files

    manifest = {
        "entry_points": {"step": {"file": "model.so"}, "copy_blocks": {"file": "copy_blocks.onnx"}},
        "weights": {"file": "weights.safetensors", "tensors": []},
        "tvm": {"device_code": {"file": "model.fatbin"}},
        "files": {"file": "x"},  # names, not fields
    }
    assert dict(named_files(manifest)) == {
        "entry_points.step.file": "model.so",
        "entry_points.copy_blocks.file": "copy_blocks.onnx",
        "weights.file": "weights.safetensors",
        "tvm.device_code.file": "model.fatbin",
    }


def test_a_stray_chat_template_is_refused_not_read(artifact, tmp_path, capsys):
    """The tokenizer reads chat_template.jinja by name: dropped into an artifact without being hashed, it would
    silently change every chat prompt. It is refused (the artifact does not load) until it is removed."""
    import shutil

    from llmlower.runtime import Tokenizer

    copy = shutil.copytree(artifact, tmp_path / "copy")
    (copy / "chat_template.jinja").write_text("{{ 'INJECTED' }}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    with pytest.raises(ArtifactError, match=r"chat_template\.jinja: not in manifest\.json's files \(not hashed\)"):
        Engine.load(copy)
    with pytest.raises(ArtifactError, match=r"chat_template\.jinja: not in manifest\.json's files"):
        Tokenizer.from_dir(copy)
    assert main(["generate", str(copy), "--prompt", "x"]) == 1
    err = capsys.readouterr().err
    assert "chat_template.jinja" in err and "Traceback" not in err
    (copy / "chat_template.jinja").unlink()
    assert "INJECTED" not in Engine.load(copy).tokenizer.apply_chat_template([{"role": "user", "content": "x"}])


def test_the_tokenizer_files_must_be_hashed(artifact, tmp_path):
    def unlist(manifest, copy):
        del manifest["files"]["tokenizer_config.json"]

    with pytest.raises(ArtifactError, match=r"tokenizer_config\.json: not in manifest\.json's files"):
        Engine.load(_tampered(artifact, tmp_path, unlist))


def test_an_artifact_that_is_a_symlink_to_elsewhere_still_loads(artifact, tmp_path):
    """Only paths inside the artifact must stay inside it: the directory itself may be reached through a link."""
    link = tmp_path / "link"
    link.symlink_to(artifact, target_is_directory=True)
    Engine.load(link)
