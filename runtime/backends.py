"""The backends, one registration each: what they build for, the KV layout their programs use on each target,
and where their compiler and executors live. The compile command, the Python API, the roofline study and
Engine.load all read this table. Modules are named, not imported: the runtime never imports the compiler
side (torch), and a backend's runtime library is imported only when one of its artifacts is loaded.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from ..errors import LlmlowerError
from ..step_io import KVLayout


@dataclass(frozen=True)
class Backend:
    """`layouts`: target -> KV layout of its programs; `executors`: KV layout -> "module:Class" under
    llmlower.runtime.executors that runs its artifacts; `compiler`: "module:function" writing an artifact
    (build(program, directory, target=..., write_extra=..., **options)); `program_executor`: "module:function"
    making an executor straight from a Program (program, max_context, num_blocks) for tests and the roofline;
    `options` and `check`: the compile options it takes and the check run on them before compiling."""

    name: str
    layouts: dict[str, KVLayout]
    executors: dict[KVLayout, str]
    compiler: str | None
    program_executor: str
    summary: str
    options: tuple[str, ...] = ()  # the compile options (keywords of `compiler`) it takes
    check: str | None = None  # "module:function"(target, options) that refuses bad options before compiling

    @property
    def targets(self) -> tuple[str, ...]:
        return tuple(self.layouts)

    def layout(self, target: str) -> KVLayout:
        if target not in self.layouts:
            raise LlmlowerError(f"--target {target!r}: the {self.name} backend builds for {', '.join(self.targets)}")
        return self.layouts[target]


BACKENDS: dict[str, Backend] = {
    "torch": Backend(
        name="torch",
        layouts={"cpu": KVLayout.PAGED},
        executors={},
        compiler=None,
        program_executor="llmlower.backends.torch.executor:program_executor",
        summary="the reference: the Program's graph run eagerly by torch (no artifact)",
    ),
    "onnx": Backend(
        name="onnx",
        layouts={"cpu": KVLayout.SLOTS, "cuda": KVLayout.PAGED},
        executors={KVLayout.SLOTS: "onnx:OnnxSlotExecutor", KVLayout.PAGED: "onnx_paged:OnnxPagedExecutor"},
        compiler="llmlower.backends.onnx.artifact:build",
        program_executor="llmlower.backends.onnx.executor:program_executor",
        summary="ONNX Runtime: GroupQueryAttention over per-sequence buffers on CPU, PagedAttention on CUDA",
        options=("accuracy_level",),
    ),
    "tvm": Backend(
        name="tvm",
        layouts={"cpu": KVLayout.PAGED, "cuda": KVLayout.PAGED},
        executors={KVLayout.PAGED: "tvm:TvmExecutor"},
        compiler="llmlower.backends.tvm.artifact:build",
        program_executor="llmlower.backends.tvm.executor:program_executor",
        summary="Apache TVM: Relax + llmlower's paged-attention kernels, llvm (CPU) or CUDA",
        options=("cuda_arch", "cpu"),
        check="llmlower.backends.tvm.compile:check_options",
    ),
    "mlir": Backend(
        name="mlir",
        layouts={"cpu": KVLayout.SLOTS},
        executors={KVLayout.SLOTS: "mlir:MlirLinalgExecutor"},
        compiler="llmlower.backends.mlir.artifact:build",
        program_executor="llmlower.backends.mlir.executor:program_executor",
        summary="MLIR through torch-mlir (torch, linalg, stablehlo or tosa); linalg runs here, JIT-compiled (slow)",
        options=("dialect", "static_dims"),
        check="llmlower.backends.mlir.artifact:check_options",
    ),
}


def get_backend(name: str) -> Backend:
    if name not in BACKENDS:
        raise LlmlowerError(f"--backend {name!r}: available backends are {', '.join(BACKENDS)}")
    return BACKENDS[name]


def load_symbol(reference: str, package: str | None = None) -> Any:
    """The object a "module:name" reference names (module relative to `package` when given)."""
    module, name = reference.split(":")
    return getattr(importlib.import_module(f"{package}.{module}" if package else module), name)
