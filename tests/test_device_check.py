"""Dummy weights and the GPU check's bundle: every backend's artifact loads and steps with weights="random"
and no weights file (finite logits, the same for the same seed), cuda artifacts pass every check that comes
before a device, the manifest lists each weight as stored, and what a run on the lent GPU machine carries (the
tree plus the trimmed TVM runtime and artifacts of benchmarks/device_check) stays within its budget."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
import safetensors.numpy
from onnx.external_data_helper import uses_external_data

from benchmarks.device_check.carried import BUDGET, carried_size
from benchmarks.device_check.runtime_site import build_site
from llmlower.errors import ArgumentError, GenerationError
from llmlower.runtime import Engine, StepBatch, sequential_block_tables
from llmlower.runtime.artifact import ArtifactError, read_manifest

REPO = Path(__file__).resolve().parent.parent

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="building for cuda needs nvcc (CUDA toolkit)")
# (backend, target, quant) of the tiny Llama's artifacts
CPU_BUILDS = [
    ("onnx", "cpu", "none"),
    ("tvm", "cpu", "none"),
    ("tvm", "cpu", "q4g32"),
    ("onnx", "cpu", "q4g32"),
    ("mlir", "cpu", "q8"),
]


@pytest.fixture(scope="module")
def artifacts(tiny_llama, compiled):
    """The tiny Llama compiled per (backend, target, quant)."""

    def artifact(backend: str, target: str, quant: str = "none") -> Path:
        return compiled(tiny_llama, backend, quant, **({"target": target} if target != "cpu" else {}))

    return artifact


def without_weights(artifact: Path, destination: Path) -> Path:
    """A copy of the artifact without its weights file, as the GPU check carries it."""
    copy = shutil.copytree(artifact, destination)
    (copy / read_manifest(copy, verify=False)["weights"]["file"]).unlink()
    return copy


def first_logits(artifact: Path, seed: int) -> np.ndarray:
    executor = Engine.load(artifact, weights="random", weights_seed=seed, max_num_seqs=2, max_context=64).executor
    tables = sequential_block_tables(executor, [6, 6])
    return executor.step(StepBatch([[1, 2, 3, 4, 5], [6, 7]], [0, 0], tables))


@pytest.mark.parametrize("build", CPU_BUILDS, ids=["-".join(b) for b in CPU_BUILDS])
def test_random_weights_load_and_step_without_the_weights_file(artifacts, tmp_path, build):
    bare = without_weights(artifacts(*build), tmp_path / "bare")
    logits = first_logits(bare, seed=0)
    assert logits.shape == (2, 320) and np.isfinite(logits).all()
    assert np.array_equal(logits, first_logits(bare, seed=0))
    assert not np.array_equal(logits, first_logits(bare, seed=1))
    weights = read_manifest(artifacts(*build), verify=False)["weights"]["file"]
    with pytest.raises(ArtifactError, match=f"{weights}: listed in manifest.json but missing"):
        Engine.load(bare)


def test_the_manifest_lists_every_weight_as_stored(artifacts):
    tvm = artifacts("tvm", "cpu", "q4g32")
    listed = read_manifest(tvm)["weights"]["tensors"]
    stored = safetensors.numpy.load_file(str(tvm / "weights.safetensors"))
    assert {t["name"] for t in listed} == set(stored)
    for tensor in listed:
        array = stored[tensor["name"]]
        assert (list(array.shape), array.dtype.name) == (tensor["shape"], tensor["dtype"])
    assert {"uint8", "float32"} <= {t["dtype"] for t in listed}  # packed int4 and its scales
    onnx_artifact = artifacts("onnx", "cpu", "q4g32")
    model = onnx.load(str(onnx_artifact / "model.onnx"), load_external_data=False)
    external = {t.name: list(t.dims) for t in model.graph.initializer if uses_external_data(t)}
    listed = read_manifest(onnx_artifact)["weights"]["tensors"]
    assert {t["name"]: t["shape"] for t in listed} == external


def test_an_unknown_weights_value_or_seed_is_refused_by_name(artifacts):
    artifact = artifacts("tvm", "cpu")
    with pytest.raises(ArgumentError, match="weights='dummy': expected one of 'auto'.*'random'"):
        Engine.load(artifact, weights="dummy")
    with pytest.raises(ArgumentError, match="weights_seed=-1"):
        Engine.load(artifact, weights="random", weights_seed=-1)


@needs_nvcc
def test_cuda_artifacts_without_weights_pass_every_check_before_the_device(artifacts, tmp_path):
    import tvm

    if tvm.cuda(0).exist:
        pytest.skip("this machine has a CUDA device: the GPU check runs these artifacts")
    bare = without_weights(artifacts("tvm", "cuda"), tmp_path / "tvm")
    with pytest.raises(ArtifactError, match="runs on CUDA, and TVM's runtime here finds no CUDA device"):
        Engine.load(bare, weights="random")  # the manifest, paths and hashes passed; the weights were not needed
    with pytest.raises(ArtifactError, match="weights.safetensors: listed in manifest.json but missing"):
        Engine.load(bare)
    bare = without_weights(artifacts("onnx", "cuda"), tmp_path / "onnx")
    with pytest.raises(GenerationError, match="needs the CUDA execution provider"):
        Engine.load(bare, weights="random")


@needs_nvcc  # the trimmed runtime carries the libcudart TVM's CUDA runtime links, from the CUDA toolkit
def test_the_trimmed_tvm_runtime_runs_alone_and_the_carried_set_fits(artifacts, tmp_path):
    bundle = tmp_path / "bundle"
    trace = build_site(bundle / "site", artifacts("tvm", "cpu"))
    assert trace["runtime_only"] and trace["finite"]
    assert all(Path(f).is_relative_to(bundle / "site") for f in [*trace["files"], *trace["libraries"]])
    assert not (bundle / "site" / "tvm" / "lib" / "libtvm_compiler.so").exists()
    for build in [("tvm", "cuda", "none"), ("onnx", "cuda", "none"), ("tvm", "cpu", "none")]:
        shutil.copytree(artifacts(*build), bundle / "models" / "-".join(build))
    size = carried_size(REPO, [bundle])
    assert size.tree > 0 and size.carried[str(bundle)] > 8 << 20  # TVM's runtime libraries alone are more
    assert size.total <= BUDGET, size.describe()


def test_the_prepared_bundle_fits_and_carries_no_speed_weights():
    """The bundle prepare.py built (when it has been built here): its real size, and its speed artifacts."""
    bundle = REPO / "build" / "device-check" / "bundle"
    if not (bundle / "plan.json").is_file():
        pytest.skip("benchmarks/device_check/prepare.py has not built build/device-check/bundle here")
    size = carried_size(REPO, [bundle.relative_to(REPO)])
    assert size.total <= BUDGET, size.describe()
    plan = json.loads((bundle / "plan.json").read_text())
    for name in plan["speed"]:
        artifact = bundle / "models" / name
        manifest = read_manifest(artifact, weights=False)  # every other file present and hashed
        assert not (artifact / manifest["weights"]["file"]).exists()
        assert set(plan["builds"][name]["costs"]) == {str(b) for b in plan["batches"]}
