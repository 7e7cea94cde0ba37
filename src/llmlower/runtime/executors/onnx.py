"""Executor on ONNX Runtime's CPU EP for SLOTS programs (needs numpy and onnxruntime only).

ONNX Runtime has no CPU kernel for PagedAttention. GroupQueryAttention instead appends in place to a cache
whose rows are sequences: each layer's cache is one numpy array [slots, kv_heads, slot positions, head_dim],
and a step binds a range of its rows as the op's past *and* present (IO binding, the same memory), so no step
copies the cache (benchmarks/kv_layouts_onnx_cpu.py measured the alternatives). The block manager gives each
sequence a slot (its blocks are that slot's), so the slots of a step's decodes may have gaps: the rows in
between run a throwaway token at position 0 whose cache entries (and recurrent states) are saved before the run
and put back after it, and every decode still shares one run. GroupQueryAttention takes several tokens after a
past only for one sequence at a time: prompt chunks run one per session run.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from ...errors import GenerationError
from ...step_io import DEFAULT_BLOCK_SIZE, INPUT_IDS, LOGITS, LOGITS_INDICES, PRESENT_PREFIX, cache_layer
from ..executor import (
    PaddedBatch,
    SlotExecutor,
    StepBatch,
    pad_batch,
    state_shapes,
    step_arrays,
    step_logits,
)
from ..lora import LoraBank
from ..weights import ARTIFACT_WEIGHTS, WeightSource

DTYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int8)": np.int8}
OPTIMIZATION_LEVELS = {
    "none": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}


# SmolLM2 q4mix decode at batch 1 on the 2-core VM (128 greedy tokens, median of 7, the settings interleaved):
# ONNX Runtime's defaults 124 tok/s; smaller parallel-for blocks (dynamic_block_base 4: a decode step's small
# matmuls split into more, cheaper chunks between the two threads) 132; and flushing denormal floats to zero
# (no slow microcode path on tiny activations; inference engines run so) 136.
SESSION_CONFIG = {"session.dynamic_block_base": "4", "session.set_denormal_as_zero": "1"}


def session_options(threads: int = 0, optimization: str = "all", profile: bool = False) -> ort.SessionOptions:
    """intra-op threads (0: ONNX Runtime's default, one per physical core), the graph optimization level, and
    ONNX Runtime's per-operator profiling (a JSON trace; session.end_profiling() names the file)."""
    if optimization not in OPTIMIZATION_LEVELS:
        raise GenerationError(f"optimization must be one of {', '.join(OPTIMIZATION_LEVELS)}, got {optimization!r}")
    if threads < 0:
        raise GenerationError(f"threads must be >= 0, got {threads}")
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    for key, value in SESSION_CONFIG.items():
        options.add_session_config_entry(key, value)
    options.graph_optimization_level = OPTIMIZATION_LEVELS[optimization]
    options.enable_profiling = profile
    options.profile_file_prefix = os.path.join(tempfile.gettempdir(), "llmlower_onnxruntime_profile")
    return options


def external_initializers(
    options: ort.SessionOptions, initializers: Mapping[str, np.ndarray] | None
) -> list[ort.OrtValue]:
    """Have a session take these values for the model's external initializers instead of reading its weights
    file (dummy weights: runtime.weights); returns the OrtValues, which must outlive the session."""
    if not initializers:
        return []
    values = [ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(a)) for a in initializers.values()]
    options.add_external_initializers(list(initializers), values)
    return values


class BoundStep:
    """A step session's IO binding: the caches stay bound between runs (the executor binds them); each run binds
    the step's small inputs and a fresh host array for the logits, whose shape the step determines."""

    def __init__(self, session: ort.InferenceSession) -> None:
        self.session = session
        self.binding = session.io_binding()
        self.inputs = {spec.name for spec in session.get_inputs()}
        logits = session.get_outputs()[0]
        if logits.name != LOGITS or not isinstance(logits.shape[-1], int):
            raise GenerationError(f"not a step model: its first output is {logits.name} of shape {logits.shape}")
        self.all_positions = logits.shape[1] != 1  # every position's logits, not only logits_indices'
        self.vocab, self.logits_dtype = logits.shape[-1], DTYPES[logits.type]

    def run(self, arrays: dict[str, np.ndarray]) -> np.ndarray:
        """Bind the inputs the model takes, run, return the logits: [batch, tokens, vocab] for every position,
        else [len(logits_indices), 1, vocab]."""
        for name, value in arrays.items():
            if name in self.inputs:
                self.binding.bind_cpu_input(name, np.ascontiguousarray(value))
        rows = arrays[INPUT_IDS].shape if self.all_positions else (len(arrays[LOGITS_INDICES]), 1)
        logits = np.empty((*rows, self.vocab), self.logits_dtype)
        self.binding.bind_output(LOGITS, "cpu", 0, logits.dtype, list(logits.shape), logits.ctypes.data)
        self.session.run_with_iobinding(self.binding)
        return logits


class OnnxSlotExecutor(SlotExecutor):
    def __init__(
        self,
        model: bytes | str,
        max_context: int = 2048,
        num_blocks: int | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        threads: int = 0,
        optimization: str = "all",
        profile: bool = False,
        initializers: Mapping[str, np.ndarray] | None = None,
        lora: LoraBank | None = None,
    ) -> None:
        """`initializers`: values for the model's external initializers, instead of its weights file; `lora`: the
        adapter slots of a model compiled with them, bound once (loading an adapter writes into them)."""
        options = session_options(threads, optimization, profile)
        self._initializers = external_initializers(options, initializers)
        try:
            self.session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
        except Exception as error:  # onnxruntime's own errors (a truncated or foreign model), as one type
            name = model if isinstance(model, str) else "the model"
            raise GenerationError(f"{name}: onnxruntime cannot load it: {error}") from None
        layers = {
            spec.name: (spec.shape[1], spec.shape[3], DTYPES[spec.type])
            for spec in self.session.get_inputs()
            if cache_layer(spec.name) is not None
        }
        inputs = [(spec.name, spec.shape, DTYPES.get(spec.type)) for spec in self.session.get_inputs()]
        self.allocate_slots(layers, max_context, num_blocks, block_size, state_shapes(inputs))
        self.bound = BoundStep(self.session)
        self.all_positions = self.bound.all_positions
        self.bound_rows: tuple[int, int] | None = None  # (first slot, count) the caches are bound for
        self.lora = lora
        for name, array in ({} if lora is None else lora.arrays).items():
            self.bound.binding.bind_input(name, "cpu", 0, array.dtype, list(array.shape), array.ctypes.data)

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
    ) -> OnnxSlotExecutor:
        if manifest["target"] != "cpu":
            raise GenerationError(f"{artifact}: a per-sequence-cache ONNX artifact runs on the CPU EP only")
        model = str(artifact / manifest["entry_points"]["step"]["file"])
        initializers = weights.made_up(artifact, manifest)
        lora = LoraBank.of_step(manifest["entry_points"]["step"]["inputs"], manifest["pipeline"])
        return cls(model, max_context, num_blocks, block_size, threads=threads, initializers=initializers, lora=lora)

    def step(self, batch: StepBatch) -> np.ndarray:
        self.check_step(batch)
        counts = batch.logits_counts()
        slots = [table[0] // self.blocks_per_slot for table in batch.block_tables]
        if len(set(slots)) != len(slots):
            raise GenerationError(f"slots {slots}: a step runs each sequence once")
        logits: list[np.ndarray | None] = [None] * len(slots)
        decodes = [i for i, tokens in enumerate(batch.tokens) if len(tokens) == 1]
        if decodes:
            rows = self._decode(
                [slots[i] for i in decodes],
                [batch.tokens[i][0] for i in decodes],
                [batch.past_lens[i] for i in decodes],
                None if batch.lora_slots is None else [batch.lora_slots[i] for i in decodes],
            )
            for i, row in zip(decodes, rows, strict=True):
                logits[i] = row[None]
        for i, tokens in enumerate(batch.tokens):
            if len(tokens) > 1:
                lora = None if batch.lora_slots is None else [batch.lora_slots[i]]
                one = StepBatch([tokens], [batch.past_lens[i]], [batch.block_tables[i]], [int(counts[i])], None, lora)
                padded = pad_batch(one)
                logits[i] = step_logits(self._run(slots[i], padded), padded.logits_indices, self.all_positions)
        return np.concatenate(logits)

    def _decode(self, slots: list[int], tokens: list[int], past: list[int], lora: list[int] | None) -> np.ndarray:
        """One token for each slot in one run over the slots' whole range (`lora`: each one's adapter slot);
        logits in the given order."""
        first, last = min(slots), max(slots)
        count = last - first + 1
        ids = np.zeros((count, 1), dtype=np.int64)
        past_lens = np.zeros(count, dtype=np.int64)
        rows = np.array(slots) - first
        ids[rows, 0], past_lens[rows] = tokens, past
        adapters = np.full((count, 1), -1, dtype=np.int64)
        if lora is not None:
            adapters[rows, 0] = lora
        saved, saved_states = {}, {}
        if count > len(slots):  # rows in between: a throwaway token at position 0, their first entry and state kept
            idle = np.setdiff1d(np.arange(first, last + 1), slots)
            saved = {name: cache[idle, :, 0].copy() for name, cache in self.caches.items()}
            saved_states = {name: state[idle].copy() for name, state in self.states.items()}
        padded = PaddedBatch(ids, past_lens[:, None], past_lens, np.ones(count, dtype=np.int64), rows, adapters)
        logits = self._run(first, padded)
        for name, values in saved.items():
            self.caches[name][idle, :, 0] = values
        for name, values in saved_states.items():
            self.states[name][idle] = values
        return step_logits(logits, rows, self.all_positions)

    def _run(self, first_slot: int, padded: PaddedBatch) -> np.ndarray:
        """Run the model on cache rows first_slot.. (one per sequence of `padded`); returns its logits."""
        count = len(padded.input_lens)
        if self.bound_rows != (first_slot, count):
            for name, cache in {**self.caches, **self.states}.items():
                shape = [count, *cache.shape[1:]]
                pointer = cache.ctypes.data + first_slot * cache[0].nbytes
                self.bound.binding.bind_input(name, "cpu", 0, cache.dtype, shape, pointer)
                self.bound.binding.bind_output(PRESENT_PREFIX + name, "cpu", 0, cache.dtype, shape, pointer)
            self.bound_rows = (first_slot, count)
        return self.bound.run(step_arrays(padded))
