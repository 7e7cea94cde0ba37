"""Build an MLIR artifact: the step function in one dialect (model.mlir, no weights inside), its weights apart
(weights.safetensors, the function's arguments after the step inputs, in the order of the manifest's
weights.tensors) and manifest.json."""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from ...errors import LlmlowerError
from ...ir.program import Program
from ...progress import stage
from ...runtime.artifact import write_artifact
from ...runtime.weights import tensor_spec
from ...step_io import KVLayout
from ..manifest import kv_layout_manifest, program_manifest
from .export import (
    DEFAULT_DIALECT,
    FUNCTION,
    check_dialect,
    check_lowerable,
    check_static_dims,
    fixed_dims,
    lower,
    require_torch_mlir,
    torch_module,
)

MODULE, WEIGHTS = "model.mlir", "weights.safetensors"
TARGETS = ("cpu",)


def check_options(target: str, options: dict[str, Any]) -> None:
    """The backends table's check: the dialect and the fixed dimensions, before minutes of capture and passes."""
    check_dialect(options.get("dialect", DEFAULT_DIALECT))
    check_static_dims(options.get("static_dims"))
    require_torch_mlir()


def _separate(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous tensors that share no storage (safetensors refuses aliases): a view of one already saved is
    copied."""
    seen: set[int] = set()
    separate = {}
    for name, tensor in weights.items():
        tensor = tensor.detach().contiguous()
        storage = tensor.untyped_storage().data_ptr()
        separate[name] = tensor.clone() if storage in seen else tensor
        seen.add(storage)
    return separate


def build(
    program: Program,
    directory: str | Path,
    target: str = "cpu",
    dialect: str = DEFAULT_DIALECT,
    static_dims: dict[str, int] | None = None,
    write_extra: Callable[[Path], None] | None = None,
    manifest_extra: dict[str, Any] | None = None,
    check_staged: Callable[[Path], None] | None = None,
) -> Path:
    """Export `program` to MLIR in `dialect` (sizes fixed by `static_dims`, or a decode step's for a dialect
    without dynamic sizes) and write it (and whatever `write_extra` adds, e.g. tokenizer files) as an artifact;
    `check_staged` runs on it before it is moved into place (runtime.artifact.write_artifact)."""
    if target not in TARGETS:
        raise LlmlowerError(f"--target {target!r}: the mlir backend builds for {', '.join(TARGETS)}")
    check_options(target, {"dialect": dialect, "static_dims": static_dims})
    check_lowerable(program)  # an op without a decomposition (paged attention's) is named first
    if program.kv_layout is not KVLayout.SLOTS:
        raise LlmlowerError("the mlir backend needs a program with a per-sequence KV cache (the kv_cache pass)")
    fixed = fixed_dims(program, dialect, static_dims)
    with stage("import into MLIR (torch-mlir, the op set decomposed)"):
        module = torch_module(program, fixed)
    with stage(f"lower to {dialect} (torch-mlir)"):
        module = lower(module, dialect)
    weights = _separate(module.weights)

    def write(staging: Path) -> None:
        with stage("write the module and its weights"):
            (staging / MODULE).write_text(module.text, encoding="utf-8")
            safetensors.torch.save_file(weights, str(staging / WEIGHTS))
        if write_extra is not None:
            write_extra(staging)

    manifest = {
        **program_manifest(program, "mlir", target),
        "mlir": {
            "dialect": dialect,
            "op_dialects": module.op_dialects,
            "static_dims": module.static_dims,
            "torch_mlir_version": importlib.metadata.version("torch-mlir"),
        },
        "kv_layout": kv_layout_manifest(program),
        "entry_points": {
            FUNCTION: {
                "file": MODULE,
                "function": FUNCTION,
                "inputs": [t.to_dict() for t in module.inputs],  # then the weights, as weights.tensors lists them
                "outputs": [t.to_dict() for t in module.outputs],
            }
        },
        # the function's arguments after the step inputs, in this order
        "weights": {"file": WEIGHTS, "tensors": [tensor_spec(name, w.numpy()) for name, w in weights.items()]},
        **(manifest_extra or {}),
    }
    return write_artifact(directory, write, manifest, check_staged)
