"""Build an ONNX Runtime artifact: model.onnx + model.onnx.data (external weights) + manifest.json."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import onnx
from onnx import TensorProto
from onnx.external_data_helper import convert_model_to_external_data, uses_external_data

from ...errors import LlmlowerError
from ...ir.program import Program
from ...progress import stage
from ...runtime.artifact import write_artifact
from ...runtime.executors.onnx_paged import COPY_BLOCKS_FILE
from ...runtime.weights import WeightSpec
from ...step_io import KVLayout
from ..manifest import kv_layout_manifest, program_manifest
from .copy_blocks import copy_blocks_model
from .export import to_onnx

MODEL_FILE, WEIGHTS_FILE = "model.onnx", "model.onnx.data"
PROVIDERS = {"cpu": ["CPUExecutionProvider"], "cuda": ["CUDAExecutionProvider", "CPUExecutionProvider"]}


def check_target(target: str) -> None:
    if target not in PROVIDERS:
        raise LlmlowerError(f"--target {target!r}: the onnx backend builds for {', '.join(PROVIDERS)}")


def external_weights(model: onnx.ModelProto) -> list[dict[str, Any]]:
    """The manifest entries of the initializers stored in the weights file (small ones stay in model.onnx)."""
    return [
        WeightSpec(t.name, tuple(t.dims), onnx.helper.tensor_dtype_to_np_dtype(t.data_type)).to_dict()
        for t in model.graph.initializer
        if uses_external_data(t)
    ]


def build(
    program: Program,
    directory: str | Path,
    target: str = "cpu",
    accuracy_level: int = 4,
    write_extra: Callable[[Path], None] | None = None,
    manifest_extra: dict[str, Any] | None = None,
    check_staged: Callable[[Path], None] | None = None,
) -> Path:
    """Lower `program`, write it (and whatever `write_extra` adds, e.g. tokenizer files) as an artifact;
    `check_staged` runs on it before it is moved into place (runtime.artifact.write_artifact)."""
    check_target(target)
    if not program.has_kv_cache:
        raise LlmlowerError("the onnx backend needs a program with a KV cache (the kv_cache pass)")
    with stage("lower to ONNX (torch.onnx.export)"):
        model = to_onnx(program, accuracy_level=accuracy_level)
    convert_model_to_external_data(model, location=WEIGHTS_FILE)  # onnx.save below writes them to WEIGHTS_FILE
    entry_points = {
        "step": {
            "file": MODEL_FILE,
            "inputs": [t.to_dict() for t in program.inputs],
            "outputs": [t.to_dict() for t in program.outputs],
        }
    }
    copier = None
    if program.kv_layout is KVLayout.PAGED:  # block copies on the device the pools live on
        copier = copy_blocks_model(program.spec.num_layers, TensorProto.FLOAT16)
        entry_points["copy_blocks"] = {"file": COPY_BLOCKS_FILE}

    def write(staging: Path) -> None:
        with stage("write model.onnx and its weights"):
            onnx.save(model, staging / MODEL_FILE)
            if copier is not None:
                onnx.save(copier, staging / COPY_BLOCKS_FILE)
        if write_extra is not None:
            write_extra(staging)

    manifest = {
        **program_manifest(program, "onnx", target),
        "providers": PROVIDERS[target],
        "kv_layout": kv_layout_manifest(program),
        "entry_points": entry_points,
        "onnx": {"ir_version": model.ir_version, "accuracy_level": accuracy_level},
        "weights": {"file": WEIGHTS_FILE, "tensors": external_weights(model)},
        **(manifest_extra or {}),
    }
    return write_artifact(directory, write, manifest, check_staged)
