"""The torch reference executor: runs a Program's graph eagerly, with the KV cache as torch tensors.

It is the reference every other backend is checked against, so it favours plainness over speed: each step
gathers the step's cache rows (up to the longest sequence), runs the graph, and writes the rows back.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ...errors import GenerationError
from ...ir.program import INPUT_IDS, INPUT_LENS, LOGITS, PAST_LENS, POSITION_IDS, Program
from ...runtime.executor import Executor, PaddedBatch, StepBatch, last_token_logits, pad_batch


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

    def prompt_logits(self, tokens: Sequence[int]) -> np.ndarray:
        if self.program.outputs[self.program.output_names.index(LOGITS)].shape[1] == 1:
            raise GenerationError("this program computes last-token logits only; compile without last_token_logits")
        outputs = self._run([0], pad_batch(StepBatch([0], [tokens], [0])))
        return outputs[LOGITS][0].float().numpy()

    def fork(self, parent: int, child: int, length: int) -> None:
        for cache in self.caches.values():
            cache[child, :, :length] = cache[parent, :, :length]

    def step(self, batch: StepBatch) -> np.ndarray:
        padded = pad_batch(batch)
        outputs = self._run(batch.slots, padded)
        return last_token_logits(outputs[LOGITS].float().numpy(), padded.input_lens)

    def _run(self, slots: Sequence[int], padded: PaddedBatch) -> dict[str, torch.Tensor]:
        """Run the graph on the step's cache rows (up to the longest sequence) and store the rows back."""
        used = int((padded.past_lens + padded.input_lens).max())
        if used > self.max_context:
            raise GenerationError(f"step needs {used} cache positions; the executor holds {self.max_context}")
        rows = torch.as_tensor(list(slots))
        inputs = {
            INPUT_IDS: torch.from_numpy(padded.input_ids),
            POSITION_IDS: torch.from_numpy(padded.position_ids),
            PAST_LENS: torch.from_numpy(padded.past_lens),
            INPUT_LENS: torch.from_numpy(padded.input_lens),
        }
        inputs.update({name: cache[rows, :, :used] for name, cache in self.caches.items()})
        outputs = self.program(**inputs)
        for name, cache in self.caches.items():
            cache[rows, :, :used] = outputs[name]
        return outputs
