"""The torch reference executor: runs a Program's graph eagerly, with the KV cache as torch tensors.

It is the reference every other backend is checked against, so it favours plainness over speed: a step
gathers the cache it reads (a PAGED program: the blocks its sequences' tables name, renumbered; a SLOTS
program: the slots' rows up to the longest sequence), runs the graph and writes them back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import torch

from ...errors import GenerationError
from ...ir.program import Program
from ...runtime.executor import (
    Executor,
    StepBatch,
    pack_batch,
    pad_batch,
    state_arrays,
    state_shapes,
    state_slot_count,
    step_arrays,
    step_logits,
)
from ...runtime.lora import LoraBank
from ...step_io import DEFAULT_BLOCK_SIZE, DEFAULT_SEQUENCES, LOGITS, LOGITS_INDICES, KVLayout, cache_layer


class TorchExecutor(Executor):
    def __init__(
        self,
        program: Program,
        max_context: int | None = None,
        num_blocks: int | None = None,
        block_size: int | None = None,
    ) -> None:
        if program.kv_layout is None:
            raise ValueError("the torch executor runs programs with a KV cache: apply the kv_cache pass first")
        spec = program.spec
        self.program = program
        self.kv_layout = program.kv_layout
        paged = self.kv_layout is KVLayout.PAGED
        if paged and block_size not in (None, program.block_size):
            raise GenerationError(f"block_size {block_size}: the program's KV blocks hold {program.block_size}")
        self.block_size = program.block_size if paged else block_size or DEFAULT_BLOCK_SIZE
        self.max_context = min(max_context or spec.max_positions, spec.max_positions)
        per_sequence = -(-self.max_context // self.block_size)
        self.num_blocks = num_blocks or DEFAULT_SEQUENCES * per_sequence
        self.caches: dict[str, torch.Tensor] = {}
        # recurrent states as numpy arrays, as the runtime's executors keep them (bfloat16's in float32: numpy has none)
        specs = [(t.name, t.shape, np.float16 if t.dtype == "float16" else np.float32) for t in program.inputs]
        self.states = state_arrays(
            state_shapes(specs), state_slot_count(self.num_blocks, self.max_context, self.block_size)
        )
        self.state_dtypes = {t.name: getattr(torch, t.dtype) for t in program.inputs if t.name in self.states}
        self.num_state_slots = len(next(iter(self.states.values()))) if self.states and paged else 0
        for t in program.inputs:
            if cache_layer(t.name) is None:
                continue
            if paged:  # [num_blocks, block_size, kv_heads, head_dim]
                shape = (self.num_blocks, *t.shape[1:])
            else:  # [slots, kv_heads, slot positions, head_dim]
                shape = (self.num_blocks // per_sequence, t.shape[1], per_sequence * self.block_size, t.shape[3])
            self.caches[t.name] = torch.zeros(shape, dtype=getattr(torch, t.dtype))  # the model's, or int8
        self.lora = LoraBank.of_step([t.to_dict() for t in program.inputs], [r.to_dict() for r in program.history])

    @property
    def all_positions(self) -> bool:
        """The program returns every position's logits (no last_token_logits)."""
        return self.program.outputs[self.program.output_names.index(LOGITS)].shape[1] != 1

    def step(self, batch: StepBatch) -> np.ndarray:
        self.check_step(batch)
        outputs, arrays = self._run(batch)
        return step_logits(outputs[LOGITS].float().numpy(), arrays[LOGITS_INDICES], self.all_positions)

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        for cache in self.caches.values():
            for source, destination in pairs:
                if self.kv_layout is KVLayout.PAGED:
                    cache[destination] = cache[source]
                else:
                    cache[self.slot_rows(destination)] = cache[self.slot_rows(source)]
        if self.states and self.kv_layout is KVLayout.SLOTS:  # PAGED forks copy state rows (copy_state_slots)
            self.copy_states(pairs)

    def _run(self, batch: StepBatch) -> tuple[dict[str, torch.Tensor], dict[str, np.ndarray]]:
        """Run a step; returns the program's outputs and the step's input arrays."""
        if self.kv_layout is KVLayout.PAGED:
            return self._run_paged(batch)
        return self._run_slots(batch)

    def _inputs(self, arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        """The step's arrays and the adapter slots' weights as tensors."""
        lora = {} if self.lora is None else self.lora.arrays
        return {name: torch.from_numpy(array) for name, array in {**arrays, **lora}.items()}

    def _run_paged(self, batch: StepBatch) -> tuple[dict[str, torch.Tensor], dict[str, np.ndarray]]:
        """Run on the blocks the step's tables name (renumbered 0..n-1) and store them back."""
        packed = pack_batch(batch)
        blocks, local = np.unique(packed.block_tables, return_inverse=True)
        rows = torch.from_numpy(blocks)
        packed = replace(packed, block_tables=local.reshape(packed.block_tables.shape))
        if self.states:  # the rows the step's state slots name, renumbered as the blocks are
            packed = packed.with_state_rows()
            slots, local_slots = np.unique(packed.state_slots, return_inverse=True)
            packed = replace(packed, state_slots=local_slots.astype(np.int64))
        arrays = step_arrays(packed)
        inputs = self._inputs(arrays)
        inputs.update({name: cache[rows] for name, cache in self.caches.items()})
        inputs.update(
            {name: torch.from_numpy(state[slots]).to(self.state_dtypes[name]) for name, state in self.states.items()}
        )
        outputs = self.program(**inputs)
        for name, cache in self.caches.items():
            cache[rows] = outputs[name]
        for name, state in self.states.items():
            state[slots] = outputs[name].float().numpy()
        return outputs, arrays

    def _run_slots(self, batch: StepBatch) -> tuple[dict[str, torch.Tensor], dict[str, np.ndarray]]:
        """Run on the slots' rows up to the longest sequence and store them back."""
        padded = pad_batch(batch)
        slots = [table[0] // self.blocks_per_slot for table in batch.block_tables]
        used = int((padded.past_lens + padded.input_lens).max())
        rows = torch.as_tensor(slots)
        arrays = step_arrays(padded)
        inputs = self._inputs(arrays)
        inputs.update({name: cache[rows, :, :used] for name, cache in self.caches.items()})
        inputs.update(
            {name: torch.from_numpy(state[slots]).to(self.state_dtypes[name]) for name, state in self.states.items()}
        )
        outputs = self.program(**inputs)
        for name, cache in self.caches.items():
            cache[rows, :, :used] = outputs[name]
        for name, state in self.states.items():
            state[slots] = outputs[name].float().numpy()
        return outputs, arrays


def program_executor(program: Program, max_context: int, num_blocks: int | None = None) -> TorchExecutor:
    """The backends table's entry: a TorchExecutor for `program`."""
    return TorchExecutor(program, max_context=max_context, num_blocks=num_blocks)
