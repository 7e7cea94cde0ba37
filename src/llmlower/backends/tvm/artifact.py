"""Build a TVM artifact: the compiled library (model.so, device code included for cuda), the weights beside it
(weights.safetensors, never baked into the library) and manifest.json."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import safetensors.numpy

from ...errors import LlmlowerError
from ...ir.program import Program
from ...progress import stage
from ...runtime.artifact import write_artifact
from ...runtime.weights import tensor_spec
from ...step_io import KVLayout, cache_layer
from ..manifest import kv_layout_manifest, program_manifest
from .compile import accuracy_level as level
from .compile import compile_module, cpu_manifest, cuda_binary, tvm_target
from .compile import vm_exec as vm_exec_mode
from .relax_import import COPY_BLOCKS, COPY_INDICES, STEP, logits_output, to_relax

LIBRARY, WEIGHTS, DEVICE_CODE = "model.so", "weights.safetensors", "model.fatbin"


def build(
    program: Program,
    directory: str | Path,
    target: str = "cpu",
    accuracy_level: int | None = None,
    cuda_arch: str | None = None,
    cpu: str | None = None,
    vm_exec: str | None = None,
    write_extra: Callable[[Path], None] | None = None,
    manifest_extra: dict[str, Any] | None = None,
    check_staged: Callable[[Path], None] | None = None,
) -> Path:
    """Lower and compile `program` for `target` and write it (and whatever `write_extra` adds) as an artifact;
    `check_staged` runs on it before it is moved into place (runtime.artifact.write_artifact)."""
    tvm_tgt = tvm_target(target, cuda_arch, cpu)
    exec_mode = vm_exec_mode(target, vm_exec)
    if program.kv_layout is not KVLayout.PAGED:
        raise LlmlowerError("the tvm backend needs a program with a paged KV cache (kv_cache, then paged_attention)")
    with stage("lower to Relax (from_exported_program, paged attention over block pools)"):
        model = to_relax(program, tvm_tgt, level(target, accuracy_level))
    with stage(f"compile with TVM for {tvm_tgt.kind.name} ({tvm_tgt.attrs.get('arch') or tvm_tgt.attrs['mcpu']})"):
        executable = compile_module(model.module, tvm_tgt, exec_mode)
    device_code = None
    if target == "cuda":
        with stage(f"compile the GPU kernels with nvcc for {tvm_tgt.attrs['arch']}"):
            source, device_code = cuda_binary(executable, tvm_tgt)

    def write(staging: Path) -> None:
        with stage("write the library and its weights"):
            executable.export_library(str(staging / LIBRARY))
            safetensors.numpy.save_file(model.params, str(staging / WEIGHTS))
            if device_code is not None:
                (staging / DEVICE_CODE).write_bytes(device_code)
        if write_extra is not None:
            write_extra(staging)

    declared = {t.name: t.to_dict() for t in program.inputs}
    inputs = [declared.get(name, {"name": name}) for name in model.inputs]
    logits = logits_output(program).to_dict()
    pools = [spec_ for name, spec_ in declared.items() if cache_layer(name) is not None]  # KV pools, layer by layer
    indices = [{"name": name, "dtype": "int32", "shape": ["count"]} for name in COPY_INDICES]
    manifest = {
        **program_manifest(program, "tvm", target),
        "tvm": {
            "target": str(tvm_tgt),
            "cuda_arch": tvm_tgt.attrs.get("arch"),
            **cpu_manifest(tvm_tgt),  # triple, cpu and cpu_features: checked against the host when loaded
            "accuracy_level": model.accuracy_level,
            "vm_exec": exec_mode,
        },
        "kv_layout": kv_layout_manifest(program),
        "entry_points": {
            STEP: {"file": LIBRARY, "function": STEP, "inputs": inputs, "outputs": [logits]},
            COPY_BLOCKS: {"file": LIBRARY, "function": COPY_BLOCKS, "inputs": pools + indices, "outputs": pools},
        },
        "weights": {"file": WEIGHTS, "tensors": [tensor_spec(name, array) for name, array in model.params.items()]},
        **(manifest_extra or {}),
    }
    if device_code is not None:
        source_hash = hashlib.sha256(source.encode()).hexdigest()
        manifest["tvm"]["device_code"] = {"file": DEVICE_CODE, "format": "fatbin", "source_sha256": source_hash}
    return write_artifact(directory, write, manifest, check_staged)
