"""The benchmarks' cached artifacts: reused while they are what this compiler builds, compiled again once its
source changes (an editable install keeps its version between commits)."""

from __future__ import annotations

from benchmarks.artifacts import ensure_artifact


def test_a_benchmark_artifact_is_reused_until_the_compiler_source_changes(tiny_llama, tmp_path):
    directory = tmp_path / "tiny-onnx"
    manifest = directory / "manifest.json"
    ensure_artifact(str(tiny_llama), "onnx", {}, directory)
    built = manifest.stat().st_mtime_ns
    ensure_artifact(str(tiny_llama), "onnx", {}, directory)
    assert manifest.stat().st_mtime_ns == built
    directory.with_name("tiny-onnx.compiler-source").write_text("0" * 64)  # as another compiler left it
    ensure_artifact(str(tiny_llama), "onnx", {}, directory)
    assert manifest.stat().st_mtime_ns != built
