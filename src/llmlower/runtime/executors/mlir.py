"""Executor for linalg MLIR artifacts (needs numpy, safetensors and torch-mlir only; no torch).

The module is compiled for this CPU when the artifact loads, by torch-mlir's reference-backend passes and MLIR's
execution engine (runtime.linalg_jit): scalar loops, so far slower than the other backends, but it runs exactly
what the mlir backend emits. The step function is pure: it takes the caches and returns them updated, so a step
gathers its sequences' slots (SLOTS layout, as the ONNX CPU executor keeps them) up to the longest sequence,
calls the function and writes the rows back.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import GenerationError
from ...step_io import DEFAULT_BLOCK_SIZE, LOGITS, cache_layer
from ..artifact import MANIFEST, ArtifactError
from ..executor import (
    PaddedBatch,
    SlotExecutor,
    StepBatch,
    pad_batch,
    state_shapes,
    step_arrays,
    step_logits,
)
from ..linalg_jit import LinalgFunction
from ..lora import LoraBank
from ..weights import ARTIFACT_WEIGHTS, WeightSource


def refusal(manifest: dict[str, Any]) -> str | None:
    """Why this runtime cannot run an MLIR artifact (a module for other MLIR compilers), or None."""
    mlir = manifest.get("mlir", {})
    if mlir.get("dialect") != "linalg":
        return (
            f"a {mlir.get('dialect')!r} MLIR module is for other MLIR compilers; this runtime runs linalg modules "
            "(compile with --dialect linalg)"
        )
    if mlir.get("static_dims"):
        return (
            f"a module with fixed sizes {mlir['static_dims']} is for other MLIR compilers; this runtime runs the "
            "dynamic one (compile without --static-dims)"
        )
    return None


def runs_here(manifest: dict[str, Any]) -> bool:
    """Whether Engine.load runs this MLIR artifact (the CLI says so after compiling)."""
    return refusal(manifest) is None


class MlirLinalgExecutor(SlotExecutor):
    """Runs a linalg module's `step` function: its arguments are the step inputs then the weights (in order)."""

    def __init__(
        self,
        module: str,
        inputs: Sequence[dict[str, Any]],
        outputs: Sequence[dict[str, Any]],
        weights: Sequence[np.ndarray],
        max_context: int,
        num_blocks: int | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        function: str = "step",
        lora: LoraBank | None = None,
    ) -> None:
        """`lora`: the adapter slots of a module compiled with them."""
        self.lora = lora
        self.function = LinalgFunction(module, function, bound=weights)
        self.input_names = [spec["name"] for spec in inputs]
        self.output_names = [spec["name"] for spec in outputs]
        layers = {
            spec["name"]: (spec["shape"][1], spec["shape"][3], np.dtype(spec["dtype"]).type)
            for spec in inputs
            if cache_layer(spec["name"]) is not None
        }
        specs = [(spec["name"], spec["shape"], np.dtype(spec["dtype"]).type) for spec in inputs]
        self.allocate_slots(layers, max_context, num_blocks, block_size, state_shapes(specs))
        logits = next(spec for spec in outputs if spec["name"] == LOGITS)
        self.all_positions = logits["shape"][1] != 1

    @classmethod
    def refusal(cls, manifest: dict[str, Any]) -> str | None:
        """A module for other MLIR compilers (another dialect, fixed sizes) does not run here."""
        return refusal(manifest)

    @classmethod
    def from_artifact(
        cls,
        artifact: Path,
        manifest: dict[str, Any],
        num_blocks: int,
        block_size: int,
        max_context: int,
        threads: int,
        weights: WeightSource = ARTIFACT_WEIGHTS,
    ) -> MlirLinalgExecutor:
        """The artifact's module compiled for this CPU (a module refusal() names is refused) with its weights
        (or made-up ones); `threads` does not apply: the compiled loops run on one."""
        reason = refusal(manifest)
        if reason is not None:
            raise ArtifactError(f"{artifact / MANIFEST}: {reason}")
        entry = manifest["entry_points"]["step"]
        arrays = list(weights.arrays(artifact, manifest).values())
        module = (artifact / entry["file"]).read_text(encoding="utf-8")
        lora = LoraBank.of_step(entry["inputs"], manifest["pipeline"])
        return cls(
            module,
            entry["inputs"],
            entry["outputs"],
            arrays,
            max_context,
            num_blocks,
            block_size,
            entry["function"],
            lora,
        )

    def step(self, batch: StepBatch) -> np.ndarray:
        self.check_step(batch)
        padded = pad_batch(batch)
        return step_logits(self._run(batch, padded), padded.logits_indices, self.all_positions)

    def _run(self, batch: StepBatch, padded: PaddedBatch) -> np.ndarray:
        """Call the function on the step's slots up to the longest sequence, store the caches it returns;
        returns its logits."""
        slots = np.array([table[0] // self.blocks_per_slot for table in batch.block_tables])
        if len(set(slots.tolist())) != len(slots):
            raise GenerationError(f"slots {slots.tolist()}: a step runs each sequence once")
        used = int((padded.past_lens + padded.input_lens).max())
        arrays = {**step_arrays(padded), **{name: cache[slots, :, :used] for name, cache in self.caches.items()}}
        arrays |= {name: state[slots] for name, state in self.states.items()}
        arrays |= self.lora.arrays if self.lora else {}
        results = dict(zip(self.output_names, self.function(*[arrays[n] for n in self.input_names]), strict=True))
        for name, cache in self.caches.items():
            cache[slots, :, :used] = results[name]
        for name, state in self.states.items():
            state[slots] = results[name]
        return results[LOGITS]
