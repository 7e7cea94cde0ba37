"""The continuous-batching scheduler: which sequences run in the next step, and how many tokens each brings.

Each step has a token budget (`max_num_batched_tokens`) and a sequence cap (`max_num_seqs`). Running
sequences come first, oldest first: a decode brings one token, a prompt still being prefilled brings as much
of the rest as the budget allows (chunked prefill, so a long prompt never stalls the decodes around it).
Waiting sequences are then admitted in arrival order while the budget, the cap and the KV pool allow; a new
sequence starts after its cached prefix. A prompt that would start with a sliver (a chunk that neither finishes it
nor takes half of the budget the running sequences left) waits for the next step instead: it would not finish any
sooner, and where each prompt chunk is a model run of its own (the CPU ONNX executor) the sliver adds a run. When a
running sequence needs a block and the pool has none, the newest running sequence is preempted: its blocks are
freed and it goes back to the front of the queue, to be recomputed (its prompt and output so far) when there is
room again.

With speculative decoding (`num_lookahead_tokens` k > 0) a decoding sequence is also given room for k proposed
tokens: blocks for them and k more tokens of the step's budget (fewer when the budget or the context is short);
`ScheduledSequence.num_lookahead` says how many the proposer may fill.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from ..errors import GenerationError
from .block_manager import BlockManager


@dataclass(eq=False)
class Sequence:
    """What the scheduler tracks of a sequence: its tokens (prompt, then output) and how many of them have
    their KV in the cache. `width`: the sequences it will become (an n > 1 request's first one)."""

    seq_id: int
    token_ids: list[int]
    prompt_len: int
    num_computed: int = 0
    width: int = 1
    preemptions: int = 0  # times its KV was dropped (a draft model's cache of it is then stale too)
    cache_salt: bytes = b""  # where its prefix-cache hashes start: KV computed by a LoRA adapter is its own

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed


@dataclass(frozen=True)
class ScheduledSequence:
    sequence: Sequence
    num_tokens: int  # new tokens it brings to this step, after its num_computed cached ones
    num_lookahead: int = 0  # room (blocks and budget) for this many speculative tokens after them


class Scheduler:
    def __init__(
        self,
        blocks: BlockManager,
        max_num_seqs: int = 16,
        max_num_batched_tokens: int = 128,
        num_lookahead_tokens: int = 0,
        max_context: int | None = None,
    ) -> None:
        if max_num_seqs < 1:
            raise GenerationError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if max_num_batched_tokens < max_num_seqs:  # else the newest running sequences would never get a turn
            raise GenerationError(
                f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= max_num_seqs ({max_num_seqs})"
            )
        self.blocks = blocks
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.num_lookahead_tokens, self.max_context = num_lookahead_tokens, max_context
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0

    def add(self, sequence: Sequence) -> None:
        """Queue a new sequence (arrival order)."""
        self.waiting.append(sequence)

    def add_running(self, sequence: Sequence) -> None:
        """A sequence that already holds its blocks (a fork) joins the running ones."""
        self.running.append(sequence)

    def remove(self, sequence: Sequence) -> None:
        """A finished or aborted sequence: out of the queues, its blocks freed."""
        if sequence in self.running:
            self.running.remove(sequence)
        elif sequence in self.waiting:
            self.waiting.remove(sequence)
        self.blocks.free(sequence.seq_id)

    def schedule(self) -> list[ScheduledSequence]:
        """The next step's sequences and their token counts; admits and preempts as needed."""
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSequence] = []
        preempted = False
        index = 0
        while index < len(self.running) and budget > 0:
            sequence = self.running[index]
            count = min(sequence.num_uncomputed, budget)
            if count == 0:  # nothing new to compute (its next token is not sampled yet)
                index += 1
                continue
            lookahead = self._lookahead(sequence, budget - count)
            while not self.blocks.allocate(sequence.seq_id, sequence.num_computed + count + lookahead):
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is sequence:
                    break
            else:
                scheduled.append(ScheduledSequence(sequence, count, lookahead))
                budget -= count + lookahead
                index += 1
                continue
            break
        room = budget  # what the running sequences left: the most a new prompt's chunk can take in this step
        while self.waiting and budget > 0 and not preempted:
            sequence = self.waiting[0]
            if len(self.running) + sequence.width > self.max_num_seqs or self._sliver(sequence, budget, room):
                break
            cached = self.blocks.admit(
                sequence.seq_id, sequence.token_ids, len(self.running), sequence.width, sequence.cache_salt
            )
            if cached is None:
                break
            count = min(len(sequence.token_ids) - cached, budget)
            if not self.blocks.allocate(sequence.seq_id, cached + count):
                self.blocks.free(sequence.seq_id)
                break
            sequence.num_computed = cached
            self.waiting.popleft()
            self.running.append(sequence)
            scheduled.append(ScheduledSequence(sequence, count))
            budget -= count
        return scheduled

    def _sliver(self, sequence: Sequence, budget: int, room: int) -> bool:
        """Whether a waiting sequence would start with a chunk that neither finishes its prompt nor takes half of
        the step's `room`."""
        if len(sequence.token_ids) <= budget or 2 * budget >= room:
            return False
        return len(sequence.token_ids) - self.blocks.cached_tokens(sequence.token_ids, sequence.cache_salt) > budget

    def _lookahead(self, sequence: Sequence, budget: int) -> int:
        """Speculative room for a decoding sequence (one token to compute, its prompt done): k, or what the
        step's budget and the context leave."""
        if sequence.num_uncomputed != 1 or len(sequence.token_ids) <= sequence.prompt_len:
            return 0
        room = self.num_lookahead_tokens if self.max_context is None else self.max_context - len(sequence.token_ids)
        return max(0, min(self.num_lookahead_tokens, budget, room))

    def _preempt(self, sequence: Sequence) -> None:
        """Free the sequence's blocks and queue it first, to be recomputed."""
        self.blocks.free(sequence.seq_id)
        sequence.num_computed = 0
        sequence.preemptions += 1
        self.waiting.appendleft(sequence)
        self.preemptions += 1
