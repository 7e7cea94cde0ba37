"""The torch reference executor: runs a Program's graph eagerly, with the KV cache as torch tensors.

It is the reference every other backend is checked against, so it favours plainness over speed: each step
gathers the step's cache rows (up to the longest sequence), runs the graph, and writes the rows back.
"""

from __future__ import annotations

import numpy as np
import torch

from ...errors import GenerationError
from ...ir.program import INPUT_IDS, INPUT_LENS, LOGITS, PAST_LENS, POSITION_IDS, Program
from ...runtime.executor import Executor, StepBatch, pad_batch


class TorchExecutor(Executor):
    def __init__(self, program: Program, max_batch: int = 4, max_context: int | None = None) -> None:
        if not program.has_kv_cache:
            raise ValueError("the torch executor runs programs with a KV cache: apply the kv_cache pass first")
        spec = program.spec
        self.program = program
        self.max_batch = max_batch
        self.max_context = min(max_context or spec.max_positions, spec.max_positions)
        dtype = getattr(torch, spec.dtype)
        self.caches = {
            t.name: torch.zeros((max_batch, t.shape[1], self.max_context, t.shape[3]), dtype=dtype)
            for t in program.inputs
            if t.shape[2:3] == ("context",)
        }

    def step(self, batch: StepBatch) -> np.ndarray:
        padded = pad_batch(batch)
        used = int((padded.past_lens + padded.input_lens).max())
        if used > self.max_context:
            raise GenerationError(f"step needs {used} cache positions; the executor holds {self.max_context}")
        slots = torch.as_tensor(list(batch.slots))
        inputs = {
            INPUT_IDS: torch.from_numpy(padded.input_ids),
            POSITION_IDS: torch.from_numpy(padded.position_ids),
            PAST_LENS: torch.from_numpy(padded.past_lens),
            INPUT_LENS: torch.from_numpy(padded.input_lens),
        }
        inputs.update({name: cache[slots, :, :used] for name, cache in self.caches.items()})
        outputs = self.program(**inputs)
        for name, cache in self.caches.items():
            cache[slots, :, :used] = outputs[name]
        logits = outputs[LOGITS]
        if logits.shape[1] > 1:  # every position's logits: pick each sequence's last new token
            logits = logits[torch.arange(len(slots)), torch.from_numpy(padded.input_lens) - 1]
        else:
            logits = logits[:, 0]
        return logits.float().numpy()
