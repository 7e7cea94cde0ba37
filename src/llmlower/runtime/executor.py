"""The interface every backend's execution implements, and the batch layouts steps use (numpy only).

An executor owns the KV cache, `num_blocks` blocks of `block_size` positions in its program's layout
(step_io.KVLayout): PAGED executors read each sequence's positions through its block table; SLOTS executors
keep each sequence contiguous in a slot of `max_context` positions, slot i being blocks i * per_slot ..
(i + 1) * per_slot - 1, so a block table names its slot. The block manager decides which blocks a sequence
uses; the executor only reads and writes them.
"""

from __future__ import annotations

import itertools
import mmap
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ..errors import GenerationError
from ..step_io import (
    BLOCK_TABLES,
    DEFAULT_SEQUENCES,
    INPUT_IDS,
    INPUT_LENS,
    LOGITS_INDICES,
    LORA_SLOTS,
    PAST_LENS,
    POSITION_IDS,
    STATE_SLOTS,
    KVLayout,
    state_layer,
)
from .lora import LoraBank


@dataclass(frozen=True)
class StepBatch:
    """One forward step over several sequences: the tokens each brings (a prompt chunk, or one token in
    decode), how many it already has in the cache, and its block table (covering past and new tokens).
    `num_logits`: how many of each sequence's last new tokens get logits (default one: the last; k + 1 when
    verifying k speculative tokens). `state_slots`: each sequence's row of the recurrent states (a hybrid model's
    in the PAGED layout; in SLOTS a block table names its slot). `lora_slots`: each sequence's LoRA adapter slot
    (-1: the base model; None: every one on the base model)."""

    tokens: Sequence[Sequence[int]]
    past_lens: Sequence[int]
    block_tables: Sequence[Sequence[int]]
    num_logits: Sequence[int] | None = None
    state_slots: Sequence[int] | None = None
    lora_slots: Sequence[int] | None = None

    def token_lora_slots(self, lens: np.ndarray) -> np.ndarray | None:
        """int64 [sum(lens)]: each new token's adapter slot, the sequences' tokens one after another."""
        if self.lora_slots is None:
            return None
        return np.repeat(np.asarray(self.lora_slots, dtype=np.int64), lens)

    def logits_counts(self) -> np.ndarray:
        """int64 [seqs]: the logits rows each sequence gets, checked against its new tokens."""
        lens = np.array([len(t) for t in self.tokens], dtype=np.int64)
        counts = np.ones_like(lens) if self.num_logits is None else np.asarray(self.num_logits, dtype=np.int64)
        if counts.shape != lens.shape or (counts < 1).any() or (counts > lens).any():
            raise GenerationError(f"num_logits {list(counts)}: each needs 1..its new tokens ({lens.tolist()})")
        return counts


@dataclass(frozen=True)
class PaddedBatch:
    """A step as a SLOTS program takes it: new tokens right-padded to the longest, int64 arrays."""

    input_ids: np.ndarray  # [batch, tokens]
    position_ids: np.ndarray  # [batch, tokens]
    past_lens: np.ndarray  # [batch]
    input_lens: np.ndarray  # [batch]
    logits_indices: np.ndarray  # [logits]: flat indices into [batch, tokens] of the rows that get logits
    lora_slots: np.ndarray | None = None  # [batch, tokens]: each token's adapter slot (-1: none)


@dataclass(frozen=True)
class PackedBatch:
    """A step as a PAGED program takes it: every sequence's new tokens in one row, int64 arrays."""

    input_ids: np.ndarray  # [1, tokens]
    position_ids: np.ndarray  # [1, tokens]
    past_lens: np.ndarray  # [seqs]
    input_lens: np.ndarray  # [seqs]
    block_tables: np.ndarray  # [seqs, max blocks], unused entries 0
    logits_indices: np.ndarray  # [logits]: indices into the packed row of the tokens that get logits
    state_slots: np.ndarray | None = None  # [seqs]: each sequence's row of the recurrent states (hybrid models)
    lora_slots: np.ndarray | None = None  # [1, tokens]: each token's adapter slot (-1: none)

    def with_state_rows(self) -> PackedBatch:
        """Itself, or where the step names no state rows, sequences 0, 1, ... in rows 0, 1, ... (scoring, tests)."""
        if self.state_slots is not None:
            return self
        return replace(self, state_slots=np.arange(len(self.input_lens), dtype=np.int64))


def _last_indices(ends: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """For sequences whose new tokens end (exclusive) at flat positions `ends`, the last `counts` positions of
    each, in order."""
    starts = np.repeat(ends - counts, counts)
    return starts + np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)


def _lengths(batch: StepBatch) -> tuple[np.ndarray, np.ndarray]:
    lens = [len(t) for t in batch.tokens]
    if 0 in lens:
        raise GenerationError("every sequence in a step needs at least one new token")
    return np.asarray(batch.past_lens, dtype=np.int64), np.array(lens, dtype=np.int64)


def pad_batch(batch: StepBatch, pad_id: int = 0) -> PaddedBatch:
    """Right-pad each sequence's new tokens; padding repeats the last real position (it stays in range)."""
    past_lens, input_lens = _lengths(batch)
    width = int(input_lens.max())
    input_ids = np.full((len(input_lens), width), pad_id, dtype=np.int64)
    for row, tokens in enumerate(batch.tokens):
        input_ids[row, : len(tokens)] = tokens
    steps = np.minimum(np.arange(width)[None, :], input_lens[:, None] - 1)
    indices = _last_indices(np.arange(len(input_lens)) * width + input_lens, batch.logits_counts())
    lora = None if batch.lora_slots is None else np.repeat(np.asarray(batch.lora_slots, np.int64)[:, None], width, 1)
    return PaddedBatch(input_ids, past_lens[:, None] + steps, past_lens, input_lens, indices, lora)


def pack_batch(batch: StepBatch) -> PackedBatch:
    """Concatenate the sequences' new tokens; block tables padded to the longest with block 0. In few numpy calls:
    between two decode steps this runs with its code and data out of the caches, at ~5 us a call."""
    past_lens, input_lens = _lengths(batch)
    ids = np.fromiter(itertools.chain.from_iterable(batch.tokens), np.int64)[None]
    total = ids.shape[1]
    if total == len(input_lens):  # decode: each sequence's one token at its next position
        positions = past_lens
    else:
        starts = np.repeat(np.cumsum(input_lens) - input_lens, input_lens)
        positions = np.repeat(past_lens, input_lens) + np.arange(total) - starts
    widths = {len(t) for t in batch.block_tables}
    if len(widths) == 1:
        tables = np.array(batch.block_tables, dtype=np.int64)
    else:
        tables = np.zeros((len(input_lens), max(widths)), dtype=np.int64)
        for row, table in enumerate(batch.block_tables):
            tables[row, : len(table)] = table
    ends = np.cumsum(input_lens)
    indices = ends - 1 if batch.num_logits is None else _last_indices(ends, batch.logits_counts())
    slots = None if batch.state_slots is None else np.asarray(batch.state_slots, dtype=np.int64)
    lora = batch.token_lora_slots(input_lens)
    return PackedBatch(ids, positions[None], past_lens, input_lens, tables, indices, slots, lora)


def step_arrays(batch: PaddedBatch | PackedBatch) -> dict[str, np.ndarray]:
    """A batch's arrays under the program inputs' names (block tables too, for a packed batch; each token's
    adapter slot, -1 when the batch names none, for a program with LoRA slots)."""
    ids = batch.input_ids
    lora = np.full_like(ids, -1) if batch.lora_slots is None else batch.lora_slots.reshape(ids.shape)
    arrays = {
        INPUT_IDS: batch.input_ids,
        POSITION_IDS: batch.position_ids,
        PAST_LENS: batch.past_lens,
        INPUT_LENS: batch.input_lens,
        LOGITS_INDICES: batch.logits_indices,
        LORA_SLOTS: lora,
    }
    if isinstance(batch, PackedBatch):
        arrays[BLOCK_TABLES] = batch.block_tables
        if batch.state_slots is not None:
            arrays[STATE_SLOTS] = batch.state_slots
    return arrays


def step_logits(logits: np.ndarray, indices: np.ndarray, all_positions: bool) -> np.ndarray:
    """float32 [len(indices), vocab]: the rows a step asked for, from a program's logits — those it computed
    ([logits, 1, vocab], last_token_logits) or, `all_positions`, every position's ([rows, tokens, vocab])."""
    rows = logits.reshape(-1, logits.shape[-1])
    return (rows[indices] if all_positions else rows).astype(np.float32, copy=False)


class Executor(ABC):
    """Runs a compiled model's steps and owns its KV cache (see the module docstring)."""

    kv_layout: KVLayout
    block_size: int
    num_blocks: int
    max_context: int  # the longest sequence (prompt + output) a step may reach
    all_positions: bool  # the program returns every position's logits (no last_token_logits)
    # a hybrid model's recurrent states, name -> [slots, ...]: row i is the state of the sequence in slot i (SLOTS),
    # or of the sequence the block manager gave state slot i (PAGED: `state_slots` rows)
    states: dict[str, np.ndarray] = {}
    num_state_slots: int = 0  # PAGED with recurrent states: the rows of each state
    lora: LoraBank | None = None  # an artifact with LoRA slots: the adapters' weights every step takes

    @property
    def blocks_per_slot(self) -> int | None:
        """SLOTS layout: the blocks of one slot; None for PAGED."""
        return -(-self.max_context // self.block_size) if self.kv_layout is KVLayout.SLOTS else None

    @classmethod
    def refusal(cls, manifest: Mapping[str, Any]) -> str | None:
        """Why this machine cannot run an artifact of this executor (None: it can); compile --verify skips such
        an artifact rather than failing."""
        return None

    @abstractmethod
    def step(self, batch: StepBatch) -> np.ndarray:
        """Run one step; returns float32 logits [sum(num_logits), vocab]: each sequence's last new token (its last
        num_logits ones, in order), sequence after sequence."""

    @abstractmethod
    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy each (source, destination) block of every layer's cache, in order (copy-on-write, prefixes)."""

    def prompt_logits(self, tokens: Sequence[int]) -> np.ndarray:
        """float32 logits [len(tokens), vocab] of every position of a fresh sequence held in the first blocks
        (for scoring text, with nothing else running): one step asking for every position's logits, which needs
        a program without last_token_logits."""
        if not self.all_positions and len(tokens) > 1:
            raise GenerationError(
                "this program computes last-token logits only; compile without last_token_logits, or score one "
                "token per step (decode_logits, perplexity --decode)"
            )
        count = len(tokens)
        return self.step(StepBatch([tokens], [0], sequential_block_tables(self, [count]), [count]))

    def decode_logits(self, tokens: Sequence[int]) -> np.ndarray:
        """float32 logits [len(tokens), vocab] of every position of a fresh sequence, one token per step: what
        generation runs, where a backend's matmuls may take another kernel than for a prompt's rows."""
        table = sequential_block_tables(self, [len(tokens)])
        return np.concatenate([self.step(StepBatch([[token]], [past], table)) for past, token in enumerate(tokens)])

    def copy_states(self, pairs: Sequence[tuple[int, int]]) -> None:
        """SLOTS layout: carry the recurrent states along block copies that start a slot: a copy of a slot's first
        block into another slot's first block starts a sequence where the source's is (an n > 1 fork). Engines
        keep prefix caching off for models with a recurrent state, so no other copy starts a slot."""
        for source, destination in pairs:
            (source_slot, source_index), (slot, index) = (
                divmod(source, self.blocks_per_slot),
                divmod(destination, self.blocks_per_slot),
            )
            if source_index == index == 0 and source_slot != slot:
                self.copy_state_slots([(source_slot, slot)])

    def copy_state_slots(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy each (source, destination) row of every recurrent state, in order (an n > 1 fork, PAGED)."""
        for source, destination in pairs:
            for state in self.states.values():
                state[destination] = state[source]

    def save_states(self, slot: int) -> dict[str, np.ndarray]:
        """A copy of the recurrent states in row `slot` (to roll back rejected guesses)."""
        return {name: state[slot].copy() for name, state in self.states.items()}

    def restore_states(self, slot: int, saved: dict[str, np.ndarray]) -> None:
        """Put back what save_states returned for row `slot`."""
        for name, state in self.states.items():
            state[slot] = saved[name]

    def slot_rows(self, block: int) -> tuple[int, slice, slice]:
        """SLOTS layout: where a block lives in a cache [slots, kv_heads, positions, head_dim], its slot and
        positions (for copy_blocks)."""
        slot, index = divmod(block, self.blocks_per_slot)
        return slot, slice(None), slice(index * self.block_size, (index + 1) * self.block_size)

    def check_step(self, batch: StepBatch) -> None:
        """Refuse a step beyond the context or naming blocks outside the pool, before running anything."""
        for past, tokens, table in zip(batch.past_lens, batch.tokens, batch.block_tables, strict=True):
            total = past + len(tokens)
            if total > self.max_context:
                raise GenerationError(f"step needs {total} cache positions; the executor holds {self.max_context}")
            if len(table) * self.block_size < total or min(table) < 0 or max(table) >= self.num_blocks:
                raise GenerationError(f"block table {list(table)} does not hold {total} positions in the pool")


class SlotExecutor(Executor):
    """An executor of SLOTS programs whose caches are numpy arrays [slots, kv_heads, slot positions, head_dim]:
    each layer's whole pool, `num_blocks // blocks_per_slot` slots (default DEFAULT_SEQUENCES); a hybrid model's
    recurrent states are arrays [slots, ...], a slot's row the state of the sequence in that slot."""

    kv_layout = KVLayout.SLOTS
    caches: dict[str, np.ndarray]

    def allocate_slots(
        self,
        layers: dict[str, tuple[int, int, type]],
        max_context: int,
        num_blocks: int | None,
        block_size: int,
        states: dict[str, tuple[tuple[int, ...], type]] | None = None,
    ) -> None:
        """The caches named by `layers` (name -> (kv_heads, head_dim, dtype)), in memory committed as written,
        and the recurrent states named by `states` (name -> (one sequence's shape, dtype))."""
        self.block_size, self.max_context = block_size, max_context
        per_slot = self.blocks_per_slot
        self.num_blocks = num_blocks or DEFAULT_SEQUENCES * per_slot
        slots = self.num_blocks // per_slot
        if slots < 1:
            raise GenerationError(
                f"a KV pool of {self.num_blocks} blocks (--num-blocks, --kv-cache-memory) does not hold one sequence "
                f"of {max_context} tokens ({per_slot} blocks of {block_size}): raise it or lower --max-context"
            )
        self.caches = {
            name: lazy_zeros((slots, kv_heads, per_slot * block_size, head_dim), dtype)
            for name, (kv_heads, head_dim, dtype) in layers.items()
        }
        self.states = state_arrays(states or {}, slots)

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        for cache in self.caches.values():
            for source, destination in pairs:
                cache[self.slot_rows(destination)] = cache[self.slot_rows(source)]
        self.copy_states(pairs)


def state_arrays(shapes: dict[str, tuple[tuple[int, ...], type]], slots: int) -> dict[str, np.ndarray]:
    """Zeroed recurrent states, name -> [slots, *one sequence's shape], from state_shapes' description."""
    return {name: np.zeros((slots, *shape), dtype) for name, (shape, dtype) in shapes.items()}


def state_shapes(specs: Sequence[tuple[str, Sequence[Any], type]]) -> dict[str, tuple[tuple[int, ...], type]]:
    """The recurrent states among a step's inputs (name, shape [batch, ...], dtype): name -> (one sequence's shape,
    dtype), for SlotExecutor.allocate_slots."""
    return {
        name: (tuple(int(d) for d in shape[1:]), dtype) for name, shape, dtype in specs if state_layer(name) is not None
    }


def lazy_zeros(shape: tuple[int, ...], dtype: type) -> np.ndarray:
    """Zeros in anonymous memory that the kernel commits 4 KB page by page as it is written. (numpy's zeros
    ask for transparent huge pages: writing a sequence's first tokens would commit 2 MB of every cache row, the
    whole pool for 64 slots of 2,048 positions, where this commits about what the sequences use.)"""
    nbytes = max(1, int(np.prod(shape)) * np.dtype(dtype).itemsize)
    return np.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).reshape(shape)


def sequential_block_tables(executor: Executor, totals: Sequence[int]) -> list[list[int]]:
    """Block tables for sequences 0, 1, ... of the given lengths laid out one after another, each starting a
    slot (valid in both layouts): for tests, benchmarks and scoring without a block manager."""
    per_sequence = -(-executor.max_context // executor.block_size)
    if len(totals) * per_sequence > executor.num_blocks:
        raise GenerationError(f"{len(totals)} sequences of {executor.max_context} positions exceed the KV pool")
    return [
        list(range(i * per_sequence, i * per_sequence + -(-total // executor.block_size)))
        for i, total in enumerate(totals)
    ]


def copy_rounds(pairs: Sequence[tuple[int, int]]) -> list[tuple[list[int], list[int]]]:
    """(sources, destinations) batches that, run one after another with each batch's copies done at once
    (gathered, then scattered, or in parallel), make the pairs' copies in order: a batch never reads or writes a
    block another of its copies writes, nor writes one another reads."""
    rounds: list[tuple[list[int], list[int]]] = []
    reads: set[int] = set()
    writes: set[int] = set()
    for source, destination in pairs:
        if not rounds or source in writes or destination in writes or destination in reads:
            rounds.append(([], []))
            reads, writes = set(), set()
        rounds[-1][0].append(source)
        rounds[-1][1].append(destination)
        reads.add(source)
        writes.add(destination)
    return rounds


def state_slot_count(num_blocks: int, max_context: int, block_size: int) -> int:
    """A PAGED pool's recurrent-state rows: one per sequence of max_context tokens the pool holds, the sequences
    kv_pool_blocks charged its blocks a share of the state for."""
    return max(1, num_blocks // -(-max_context // block_size))
