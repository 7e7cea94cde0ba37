"""Executor on ONNX Runtime's CUDA EP for PAGED programs (needs numpy and onnxruntime only).

Each layer's key and value pools [num_blocks, block_size, kv_heads, head_dim] are allocated once on the GPU as
OrtValues and bound (IO binding) as both the model's pool input k_pool_<i> and its output present_k_pool_<i>:
com.microsoft.PagedAttention writes the step's keys and values into them in place (it refuses a key_cache_out
that is not key_cache's buffer), so no step copies the cache. A step binds the packed batch's small inputs
from the host (ONNX Runtime uploads them) and reads back the logits, float32 for the sequences' last tokens.

Block copies (copy-on-write of a shared prefix block) run on the GPU too: the artifact's second, tiny model
(copy_blocks.onnx) gathers the source blocks of every pool and scatters them onto the destinations (Gather +
ScatterND), with each pool bound as its input and its output; ScatterND skips its input-to-output copy when they
are the same buffer, so only the copied blocks move. Pools start zeroed: positions a kernel reads past a
sequence's end then hold zeros, never stale NaNs.

ONNX Runtime falls back to its CPU EP when it cannot start the CUDA EP (no GPU, or CUDA libraries missing),
and PagedAttention has no CPU kernel: the executor checks which EP a session really got and says so.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from ...errors import GenerationError
from ...step_io import (
    DEFAULT_SEQUENCES,
    PRESENT_PREFIX,
    KVLayout,
    cache_layer,
)
from ..executor import (
    Executor,
    PackedBatch,
    StepBatch,
    copy_rounds,
    pack_batch,
    step_arrays,
    step_logits,
)
from ..lora import LoraBank
from ..weights import ARTIFACT_WEIGHTS, WeightSource
from .onnx import BoundStep, external_initializers, session_options

CUDA = "CUDAExecutionProvider"
COPY_BLOCKS_FILE = "copy_blocks.onnx"  # the block-copy model's inputs besides the pools:
SOURCES, DESTINATIONS = "sources", "destinations"  # [pairs] and [pairs, 1], int64


def cuda_unavailable(offered: Sequence[str] | None = None) -> GenerationError:
    """The error for a host where ONNX Runtime cannot run CUDA sessions, naming what it offers."""
    offered = list(ort.get_available_providers() if offered is None else offered)
    message = f"this artifact needs the CUDA execution provider; onnxruntime here offers {', '.join(offered)}"
    if CUDA in offered:
        message += (
            f" but could not start {CUDA} (no usable NVIDIA GPU, or the CUDA / cuDNN libraries it loads are "
            "missing: onnxruntime's log above names them)"
        )
    else:
        message += " (install onnxruntime-gpu, on a machine with an NVIDIA GPU)"
    return GenerationError(message)


def copy_session(model: bytes | str, provider: Any = CUDA) -> ort.InferenceSession:
    """The block-copy model's session (one Gather and one ScatterND per pool, as written)."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model, options, providers=[provider])


class BlockCopier:
    """Block copies on the pools' device: the artifact's copy_blocks.onnx (Gather + ScatterND per pool) with
    every pool bound as its input and output, so the pools stay where they are and only copied blocks move."""

    def __init__(self, session: ort.InferenceSession, pools: dict[str, ort.OrtValue]) -> None:
        self.session = session
        self.num_blocks = next(iter(pools.values())).shape()[0]
        self.binding = self.session.io_binding()
        for name, value in pools.items():
            self.binding.bind_ortvalue_input(name, value)
            self.binding.bind_ortvalue_output(PRESENT_PREFIX + name, value)

    def copy(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy each (source, destination) block of every pool, in order."""
        for block in (b for pair in pairs for b in pair):
            if not 0 <= block < self.num_blocks:
                raise GenerationError(f"copy_blocks: block {block} is outside the pool of {self.num_blocks}")
        for sources, destinations in copy_rounds(pairs):
            self.binding.bind_cpu_input(SOURCES, np.array(sources, dtype=np.int64))
            self.binding.bind_cpu_input(DESTINATIONS, np.array(destinations, dtype=np.int64)[:, None])
            self.session.run_with_iobinding(self.binding)


class OnnxPagedExecutor(Executor):
    kv_layout = KVLayout.PAGED

    def __init__(
        self,
        model: bytes | str,
        copy_model: bytes | str,
        max_context: int = 2048,
        num_blocks: int | None = None,
        block_size: int | None = None,
        threads: int = 0,
        optimization: str = "all",
        device_id: int = 0,
        initializers: Mapping[str, np.ndarray] | None = None,
        lora: LoraBank | None = None,
    ) -> None:
        """`initializers`: values for the model's external initializers, instead of its weights file; `lora`: the
        adapter slots of a model compiled with them (copied to the device after each load)."""
        provider = (CUDA, {"device_id": device_id})
        copier = copy_session(copy_model, provider)  # a small model first: does the CUDA EP really start?
        if CUDA not in copier.get_providers():  # onnxruntime fell back to the CPU, which has no PagedAttention
            raise cuda_unavailable()
        options = session_options(threads, optimization)
        self._initializers = external_initializers(options, initializers)
        try:
            self.session = ort.InferenceSession(model, options, providers=[provider])
        except Exception as exc:  # onnxruntime's own errors (a missing kernel, a bad model), as one type
            raise GenerationError(f"onnxruntime could not load the model on {CUDA}: {exc}") from None
        pools = [spec for spec in self.session.get_inputs() if cache_layer(spec.name) is not None]
        if not pools or any(not isinstance(d, int) for d in pools[0].shape[1:]):
            raise GenerationError("not a paged-KV-cache model: no k_pool_<layer> inputs with static block shapes")
        if pools[0].type != "tensor(float16)":
            raise GenerationError(f"KV pools of {pools[0].type}: this executor keeps float16 pools")
        compiled_block_size = pools[0].shape[1]
        if block_size not in (None, compiled_block_size):
            raise GenerationError(f"block_size {block_size}: the model's KV blocks hold {compiled_block_size}")
        self.block_size, self.max_context = compiled_block_size, max_context
        self.num_blocks = num_blocks or DEFAULT_SEQUENCES * -(-max_context // self.block_size)
        self.pools = {  # each pool of its own heads and head size (values of their own size, MLA's latent)
            p.name: ort.OrtValue.ortvalue_from_numpy(
                np.zeros((self.num_blocks, self.block_size, *p.shape[2:]), dtype=np.float16), "cuda", device_id
            )
            for p in pools
        }
        self.copier = BlockCopier(copier, self.pools)
        self.bound = BoundStep(self.session)
        self.all_positions = self.bound.all_positions
        for name, value in self.pools.items():
            self.bound.binding.bind_ortvalue_input(name, value)
            self.bound.binding.bind_ortvalue_output(PRESENT_PREFIX + name, value)  # the same memory: updated in place
        self.lora, self._lora_version = lora, -1
        self._lora_values = {
            name: ort.OrtValue.ortvalue_from_numpy(array, "cuda", device_id)
            for name, array in ({} if lora is None else lora.arrays).items()
        }
        for name, value in self._lora_values.items():
            self.bound.binding.bind_ortvalue_input(name, value)

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
    ) -> OnnxPagedExecutor:
        layout = manifest.get("kv_layout", {})
        if manifest.get("target") != "cuda" or layout.get("kind") != KVLayout.PAGED.value:
            raise GenerationError(f"{artifact}: not a paged ONNX artifact for CUDA (target {manifest.get('target')})")
        if block_size != layout.get("block_size"):
            raise GenerationError(f"{artifact}: compiled for KV blocks of {layout.get('block_size')}, not {block_size}")
        context = min(max_context, manifest.get("spec", {}).get("max_positions", max_context))  # the rotary rows
        entry_points = manifest["entry_points"]
        model, copy_model = (str(artifact / entry_points[name]["file"]) for name in ("step", "copy_blocks"))
        initializers = weights.made_up(artifact, manifest)
        lora = LoraBank.of_step(entry_points["step"]["inputs"], manifest["pipeline"])
        try:
            return cls(
                model,
                copy_model,
                context,
                num_blocks,
                block_size,
                threads=threads,
                initializers=initializers,
                lora=lora,
            )
        except GenerationError as exc:
            raise GenerationError(f"{artifact}: {exc}") from None

    def step(self, batch: StepBatch) -> np.ndarray:
        self.check_step(batch)
        packed = pack_batch(batch)
        return step_logits(self._run(packed), packed.logits_indices, self.all_positions)

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        self.copier.copy(pairs)

    def _run(self, packed: PackedBatch) -> np.ndarray:
        """Run the model on a packed batch (the pools stay bound); returns its logits on the host."""
        if self.lora is not None and self._lora_version != self.lora.version:
            for name, value in self._lora_values.items():  # the device's copy of the adapters, after a load
                value.update_inplace(self.lora.arrays[name])
            self._lora_version = self.lora.version
        return self.bound.run(step_arrays(packed))
