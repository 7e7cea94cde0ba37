"""What a backend declares about itself (its package's `BACKEND`): targets and the KV layout of each, the
runtime executor that runs its artifacts, its compiler, compile options and their check, an executor straight
from a Program, and how far its logits may be from the torch reference's. Compile-side code is named by
"module:function" strings in the backend's package and imported only when used, so reading the table is cheap
and imports neither torch nor any backend's toolkit."""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass, field
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
    """`package`: the backend's package, which "module:function" references are relative to; `layouts`: target ->
    KV layout of its programs; `executors`: KV layout -> "module:Class" under llmlower.runtime.executors that runs
    its artifacts (written into each artifact's manifest); `compiler`: writes an artifact (build(program,
    directory, target=..., write_extra=..., check_staged=..., **options)), None for a backend that only runs
    in memory; `program_executor`: an executor straight from a Program (program, max_context, num_blocks) for tests
    and the roofline; `options` and `check`: the compile options it takes and the check (target, options) run on
    them before compiling; `tolerance`: how far its artifacts' logits may be from the torch reference's (compile
    --verify); `kv_cache_dtypes`: target -> the KV cache dtypes other than the model's that its attention kernels
    read (compile --kv-cache-dtype); `toolkit`: the Python modules it compiles and runs with (recipes.auto picks only
    backends whose toolkit is installed)."""

    name: str
    package: str
    layouts: dict[str, KVLayout]
    program_executor: str
    summary: str
    executors: dict[KVLayout, str] = field(default_factory=dict)
    compiler: str | None = None
    options: tuple[str, ...] = ()
    check: str | None = None
    tolerance: Tolerance = Tolerance()
    kv_cache_dtypes: dict[str, tuple[str, ...]] = field(default_factory=dict)
    toolkit: tuple[str, ...] = ()

    @property
    def targets(self) -> tuple[str, ...]:
        return tuple(self.layouts)

    @property
    def installed(self) -> bool:
        """Whether its toolkit's modules can be imported here (found, not imported: cheap)."""
        return all(importlib.util.find_spec(module) is not None for module in self.toolkit)

    def layout(self, target: str) -> KVLayout:
        """The KV layout of the programs it builds for `target` (an unknown target is refused)."""
        if target not in self.layouts:
            raise LlmlowerError(f"--target {target!r}: the {self.name} backend builds for {', '.join(self.targets)}")
        return self.layouts[target]

    def runtime_executor(self, layout: KVLayout) -> str:
        """The "module:Class" of llmlower.runtime.executors that runs its artifacts of KV layout `layout`."""
        if layout not in self.executors:
            raise LlmlowerError(f"the {self.name} backend has no runtime executor for a {layout.value} KV layout")
        return self.executors[layout]

    def load(self, reference: str) -> Any:
        """The object a "module:name" reference names in the backend's package (imported now)."""
        module, name = reference.split(":")
        return getattr(importlib.import_module(f".{module}", self.package), name)
