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
class Tolerance:
    """How far an artifact's logits may be from the torch reference's when compile --verify runs both: the largest
    |difference| over a prefill and decode steps, relative to the reference's largest |logit| (at least 1; a big
    model's logits are large, and float32 rounding grows with them), by the artifact's dtype; `rounded_activations`
    (the larger applies) for quantized weights whose matmuls also round the activations (an `accuracy_level`
    above 0 in the backend's manifest entry)."""

    # measured on the tiny test checkpoints (llama, qwen2, gemma, gpt2; fp32, q8, q4g32, q4mix): ONNX Runtime, TVM
    # and the MLIR linalg JIT stay within 1.2e-6 of the reference; 1e-4 leaves room for deeper models
    float32: float = 1e-4
    # not measured (CPU artifacts are float32 unless --dtype, and --verify does not run cuda ones): about ten
    # roundings of the dtype's unit roundoff (2^-11, 2^-8)
    float16: float = 5e-3
    bfloat16: float = 4e-2
    rounded_activations: float | None = None

    def of(self, dtype: str, rounded_activations: bool) -> float:
        """The tolerance of an artifact in `dtype` whose quantized matmuls round activations or not."""
        base = getattr(self, dtype)
        return max(base, self.rounded_activations or base) if rounded_activations else base


@dataclass(frozen=True)
class Backend:
    """`layouts`: target -> KV layout of its programs; `executors`: KV layout -> "module:Class" under
    llmlower.runtime.executors that runs its artifacts; `compiler`: "module:function" writing an artifact
    (build(program, directory, target=..., write_extra=..., check_staged=..., **options)); `program_executor`:
    "module:function" making an executor straight from a Program (program, max_context, num_blocks) for tests and
    the roofline; `options` and `check`: the compile options it takes and the check run on them before compiling;
    `tolerance`: how far its artifacts' logits may be from the torch reference's (compile --verify);
    `int8_kv_targets`: the targets whose attention kernels take an int8 KV cache (compile --kv-cache-dtype int8)."""

    name: str
    layouts: dict[str, KVLayout]
    executors: dict[KVLayout, str]
    compiler: str | None
    program_executor: str
    summary: str
    options: tuple[str, ...] = ()  # the compile options (keywords of `compiler`) it takes
    check: str | None = None  # "module:function"(target, options) that refuses bad options before compiling
    tolerance: Tolerance = Tolerance()
    int8_kv_targets: tuple[str, ...] = ()

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
        int8_kv_targets=("cpu",),
    ),
    "onnx": Backend(
        name="onnx",
        layouts={"cpu": KVLayout.SLOTS, "cuda": KVLayout.PAGED},
        executors={KVLayout.SLOTS: "onnx:OnnxSlotExecutor", KVLayout.PAGED: "onnx_paged:OnnxPagedExecutor"},
        compiler="llmlower.backends.onnx.artifact:build",
        program_executor="llmlower.backends.onnx.executor:program_executor",
        summary="ONNX Runtime: GroupQueryAttention over per-sequence buffers on CPU, PagedAttention on CUDA",
        options=("accuracy_level",),
        # MatMulNBits at accuracy_level 4 (the default) quantizes activations to int8 per block: measured up to
        # 0.034 of the logits' scale on the tiny checkpoints (q8, q4g32, q4g32-zp4, q4g128-sym, q4mix), and on
        # SmolLM2 q4g32 up to ~1.3 of ~25 (0.05, README); at level 0 it computes in float32 (1.1e-6)
        tolerance=Tolerance(rounded_activations=0.1),
        int8_kv_targets=("cpu",),  # GroupQueryAttention's PER_CHANNEL quantization; CUDA's PagedAttention has none
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
        int8_kv_targets=("cpu",),  # the CUDA kernels read float pools
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
        int8_kv_targets=("cpu",),
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
