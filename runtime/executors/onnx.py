"""Executor on ONNX Runtime: runs an ONNX model lowered from a Program (needs numpy and onnxruntime only).

The KV cache is allocated once per layer as [max_batch, kv_heads, max_context, head_dim] on the session's
device. A step binds the rows of its slots as GroupQueryAttention's past *and* present (IO binding, one
buffer), so the op appends the new keys and values in place and no step copies the cache. Slots that are
not one contiguous range run as one step per contiguous run. GroupQueryAttention takes a batch of right-padded
prompts with no past, a batch of single tokens, or one sequence continuing with several tokens; any other
step is run one sequence at a time.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from ...errors import GenerationError
from ..executor import Executor, PaddedBatch, StepBatch, last_token_logits, pad_batch

LOGITS = "logits"
PRESENT = "present_"  # the updated cache k_cache_0 is the output present_k_cache_0
CACHE_PREFIXES = ("k_cache_", "v_cache_")
DEVICES = {"CPUExecutionProvider": "cpu", "CUDAExecutionProvider": "cuda"}
DTYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16}
OPTIMIZATION_LEVELS = {
    "none": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}


def session_options(threads: int = 0, optimization: str = "all") -> ort.SessionOptions:
    """intra-op threads (0: ONNX Runtime's default, one per physical core) and the graph optimization level."""
    if optimization not in OPTIMIZATION_LEVELS:
        raise GenerationError(f"optimization must be one of {', '.join(OPTIMIZATION_LEVELS)}, got {optimization!r}")
    if threads < 0:
        raise GenerationError(f"threads must be >= 0, got {threads}")
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.graph_optimization_level = OPTIMIZATION_LEVELS[optimization]
    return options


class OnnxExecutor(Executor):
    def __init__(
        self,
        model: bytes | str,
        max_batch: int = 4,
        max_context: int = 2048,
        providers: Sequence[str] = ("CPUExecutionProvider",),
        threads: int = 0,
        optimization: str = "all",
    ) -> None:
        self.session = ort.InferenceSession(model, session_options(threads, optimization), providers=list(providers))
        self.device = DEVICES[self.session.get_providers()[0]]
        self.max_batch, self.max_context = max_batch, max_context
        self.input_names = {i.name for i in self.session.get_inputs()}
        self.caches: dict[str, ort.OrtValue] = {}
        for spec in self.session.get_inputs():
            if spec.name.startswith(CACHE_PREFIXES):
                _, kv_heads, _, head_dim = spec.shape
                zeros = np.zeros((max_batch, kv_heads, max_context, head_dim), dtype=DTYPES[spec.type])
                self.caches[spec.name] = ort.OrtValue.ortvalue_from_numpy(zeros, self.device, 0)
        self.all_positions = self.session.get_outputs()[0].shape[1] != 1
        self.binding = self.session.io_binding()
        self.binding.bind_output(LOGITS, "cpu")  # bound first: get_outputs()[0]
        self.bound_rows: tuple[int, int] | None = None  # (first slot, count) the caches are bound for

    @classmethod
    def from_artifact(
        cls, artifact: Path, manifest: dict[str, Any], max_batch: int, max_context: int, threads: int = 0
    ) -> OnnxExecutor:
        model = str(artifact / manifest["entry_points"]["step"]["file"])
        return cls(model, max_batch, max_context, providers=manifest["providers"], threads=threads)

    def step(self, batch: StepBatch) -> np.ndarray:
        if len(batch.slots) > 1 and any(batch.past_lens) and max(len(t) for t in batch.tokens) > 1:
            return self._step_parts(batch, [[i] for i in range(len(batch.slots))])
        runs = _contiguous_runs(batch.slots)
        if len(runs) > 1:
            return self._step_parts(batch, runs)
        padded = pad_batch(batch)
        return last_token_logits(self._run(batch.slots[0], padded), padded.input_lens)

    def fork(self, parent: int, child: int, length: int) -> None:
        """Copies the rows through the host (update_inplace serves the CPU and CUDA EPs alike); forks are rare."""
        for cache in self.caches.values():
            rows = cache.numpy()
            rows[child, :, :length] = rows[parent, :, :length]
            cache.update_inplace(rows)

    def prompt_logits(self, tokens: Sequence[int]) -> np.ndarray:
        if not self.all_positions:
            raise GenerationError("this model computes last-token logits only; compile without last_token_logits")
        return self._run(0, pad_batch(StepBatch([0], [tokens], [0])))[0].astype(np.float32)

    def _step_parts(self, batch: StepBatch, parts: list[list[int]]) -> np.ndarray:
        """Run a step as several smaller ones, each over the sequences at the given indices."""
        logits = [
            self.step(
                StepBatch(
                    [batch.slots[i] for i in part], [batch.tokens[i] for i in part], [batch.past_lens[i] for i in part]
                )
            )
            for part in parts
        ]
        return np.concatenate(logits)

    def _run(self, first_slot: int, padded: PaddedBatch) -> np.ndarray:
        """Run the model on cache rows first_slot.. (one per sequence of `padded`); returns its logits."""
        used = int((padded.past_lens + padded.input_lens).max())
        if used > self.max_context:
            raise GenerationError(f"step needs {used} cache positions; the executor holds {self.max_context}")
        rows = (first_slot, len(padded.input_lens))
        if self.bound_rows != rows:
            for name, cache in self.caches.items():
                self._bind_cache(name, cache, *rows)
            self.bound_rows = rows
        feeds = {
            "input_ids": padded.input_ids,
            "position_ids": padded.position_ids,
            "past_lens": padded.past_lens,
            "input_lens": padded.input_lens,
        }
        for name, value in feeds.items():
            if name in self.input_names:
                self.binding.bind_cpu_input(name, value)
        self.binding.bind_output(LOGITS, "cpu")  # a fresh array each step
        self.session.run_with_iobinding(self.binding)
        return self.binding.get_outputs()[0].numpy()

    def _bind_cache(self, name: str, cache: ort.OrtValue, first: int, count: int) -> None:
        """Bind rows first..first+count of a cache as both the past input and the present output."""
        _, *row_shape = cache.shape()
        dtype = DTYPES[cache.data_type()]
        pointer = cache.data_ptr() + first * int(np.prod(row_shape)) * np.dtype(dtype).itemsize
        self.binding.bind_input(name, self.device, 0, dtype, [count, *row_shape], pointer)
        self.binding.bind_output(PRESENT + name, self.device, 0, dtype, [count, *row_shape], pointer)


def _contiguous_runs(slots: Sequence[int]) -> list[list[int]]:
    """Indices of `slots` grouped into runs whose slots are consecutive numbers."""
    runs: list[list[int]] = []
    for index, slot in enumerate(slots):
        if runs and slot == slots[runs[-1][-1]] + 1:
            runs[-1].append(index)
        else:
            runs.append([index])
    return runs
