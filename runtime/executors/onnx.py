"""Executor on ONNX Runtime: runs an ONNX model lowered from a Program (needs numpy and onnxruntime only).

The KV cache lives here as numpy arrays [max_batch, kv_heads, max_context, head_dim] per layer; a step
feeds the rows of its sequences up to the longest one and stores the updated rows back. GroupQueryAttention
takes right-padded prompts with no past, or steps in which every sequence brings the same number of new
tokens; any other step is run one sequence at a time.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnxruntime as ort

from ...errors import GenerationError
from ..executor import Executor, PaddedBatch, StepBatch, pad_batch

LOGITS = "logits"
PRESENT = "present_"  # the updated cache k_cache_0 is the output present_k_cache_0


class OnnxExecutor(Executor):
    def __init__(
        self,
        model: bytes | str,
        max_batch: int = 4,
        max_context: int = 2048,
        providers: Sequence[str] = ("CPUExecutionProvider",),
        threads: int = 0,
    ) -> None:
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        self.session = ort.InferenceSession(model, options, providers=list(providers))
        self.max_batch, self.max_context = max_batch, max_context
        self.input_names = [i.name for i in self.session.get_inputs()]
        self.output_names = [o.name for o in self.session.get_outputs()]
        self.caches = {}
        for spec in self.session.get_inputs():
            if spec.name.startswith(("k_cache_", "v_cache_")):
                _, kv_heads, _, head_dim = spec.shape
                dtype = np.float16 if spec.type == "tensor(float16)" else np.float32
                self.caches[spec.name] = np.zeros((max_batch, kv_heads, max_context, head_dim), dtype=dtype)
        self.all_positions = self.session.get_outputs()[0].shape[1] != 1

    def step(self, batch: StepBatch) -> np.ndarray:
        uniform = len({len(t) for t in batch.tokens}) == 1
        if not uniform and any(batch.past_lens):
            rows = [self.step(StepBatch([s], [t], [p])) for s, t, p in zip(*_columns(batch), strict=True)]
            return np.concatenate(rows)
        padded = pad_batch(batch)
        logits = self._run(batch.slots, padded)
        if self.all_positions:
            logits = logits[np.arange(len(batch.slots)), padded.input_lens - 1]
        else:
            logits = logits[:, 0]
        return logits.astype(np.float32)

    def prompt_logits(self, tokens: Sequence[int]) -> np.ndarray:
        if not self.all_positions:
            raise GenerationError("this model computes last-token logits only; compile without last_token_logits")
        return self._run([0], pad_batch(StepBatch([0], [tokens], [0])))[0].astype(np.float32)

    def _run(self, slots: Sequence[int], padded: PaddedBatch) -> np.ndarray:
        used = int((padded.past_lens + padded.input_lens).max())
        if used > self.max_context:
            raise GenerationError(f"step needs {used} cache positions; the executor holds {self.max_context}")
        rows = np.asarray(slots)
        feeds = {
            "input_ids": padded.input_ids,
            "position_ids": padded.position_ids,
            "past_lens": padded.past_lens,
            "input_lens": padded.input_lens,
        }
        feeds.update({name: cache[rows, :, :used] for name, cache in self.caches.items()})
        outputs = dict(zip(self.output_names, self.session.run(self.output_names, feeds), strict=True))
        for name, cache in self.caches.items():
            cache[rows, :, :used] = outputs[PRESENT + name]
        return outputs[LOGITS]


def _columns(batch: StepBatch) -> tuple[Sequence[int], Sequence[Sequence[int]], Sequence[int]]:
    return batch.slots, batch.tokens, batch.past_lens
