"""The engine core: one step of the batch. The scheduler picks the sequences (continuous batching with chunked
prefill, admission by free KV blocks, preemption by recompute), the proposer guesses tokens when speculating, the
executor runs them as one step, and every sequence whose prompt is done gets its next tokens sampled or its
guesses verified (runtime/token_choice.py) and handed to the output processor. A request with n > 1 completions
prefills its prompt once; the other completions then share its blocks. A request whose step or tokens fail ends
alone, with an error delta.
"""

from __future__ import annotations

import copy
import logging
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from ..errors import GenerationError
from .block_manager import BlockManager
from .executor import Executor, StepBatch
from .lora import LoraAdapters
from .output_processor import OutputProcessor, deliver
from .outputs import GenerationDelta, TokenLogprob
from .proposers import Proposer
from .request import Request, RequestSequence
from .sampler import Sampler
from .scheduler import ScheduledSequence, Scheduler
from .speculative import Proposal, SpeculationStats
from .token_choice import Choice, Chosen, choose_tokens

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineStats:
    """The counters a server exports (vLLM's names): queue sizes, KV pool use, prefix cache, totals."""

    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_free: int
    kv_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    preemptions: int
    prompt_tokens: int
    generation_tokens: int
    steps: int
    finished: dict[str, int]  # completions finished, by reason: "stop", "length" or "abort"
    speculation: SpeculationStats | None = None  # with speculative decoding: proposed and accepted tokens
    state_slots_used: int = 0  # a hybrid model's recurrent-state rows held by sequences (and their forks to come)


class EngineCore:
    """Steps the requests in flight: schedules them, runs the executor (and the draft's pool alongside), chooses
    their tokens and streams them through the output processor; keeps the counters of EngineStats."""

    def __init__(
        self,
        executor: Executor,
        draft: Executor | None,
        blocks: BlockManager,
        scheduler: Scheduler,
        sampler: Sampler,
        proposer: Proposer | None,
        outputs: OutputProcessor,
        pooling: str | None = None,
        adapters: LoraAdapters | None = None,
    ) -> None:
        """`pooling`: an embedding model's (last or mean): a computed prompt is pooled into its embedding, and
        nothing is sampled; `adapters`: the LoRA adapters in the executor's slots, whose requests hold theirs."""
        self.executor = executor
        self.adapters = adapters or LoraAdapters(None)
        self.pooling = pooling
        self.draft = draft
        self.blocks = blocks
        self.scheduler = scheduler
        self.sampler = sampler
        self.proposer = proposer
        self.outputs = outputs
        self.requests: dict[str, Request] = {}
        # a hybrid model's states before the step, per sequence verifying guesses: (its past, the states), to roll
        # back to when a guess is rejected (the recurrent state cannot drop tokens as a KV cache does)
        self.rollback: dict[int, tuple[int, dict[str, np.ndarray]]] = {}
        self.speculation = SpeculationStats()
        self.prompt_tokens = self.generation_tokens = self.steps = 0
        self.finished: Counter[str] = Counter()

    def add(self, request: Request) -> None:
        """Queue a request's first sequence (the others fork from it once its prompt is computed)."""
        if request.request_id in self.requests:
            self.adapters.release(request.lora_slot)
            raise GenerationError(f"request_id {request.request_id!r} is already in use")
        self.scheduler.add(request.sequences[0])
        self.requests[request.request_id] = request

    def abort(self, request_id: str, reason: str = "abort") -> bool:
        """End a request's unfinished sequences (counted as `reason`) and free their blocks; False if it is unknown
        or already done. A request of a generate/stream call stays listed until its caller has its deltas."""
        request = self.requests.get(request_id)
        if request is None or request.done:
            return False
        for sequence in request.sequences:
            if not sequence.finished:
                sequence.finished = True
                self.finished[reason] += 1
                if sequence not in request.forks:
                    self._retire(sequence)
        request.forks = []
        self._release_adapter(request)
        if request.outbox is None:
            del self.requests[request_id]
        return True

    def has_unfinished(self) -> bool:
        """Some request still has a sequence to run."""
        return any(not request.done for request in self.requests.values())

    def stats(self) -> EngineStats:
        """The scheduler's, block manager's and step counters now."""
        return EngineStats(
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            kv_blocks_used=self.blocks.num_used_blocks,
            kv_blocks_free=self.blocks.num_free_blocks,
            kv_usage=self.blocks.usage,
            prefix_cache_queries=self.blocks.prefix.queries,
            prefix_cache_hits=self.blocks.prefix.hits,
            preemptions=self.scheduler.preemptions,
            prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens,
            steps=self.steps,
            finished=dict(self.finished),
            speculation=copy.deepcopy(self.speculation) if self.proposer is not None else None,
            state_slots_used=self.blocks.num_slots - len(self.blocks.free_slots) if self.executor.states else 0,
        )

    def step(self) -> list[GenerationDelta]:
        """Run one step of every scheduled sequence; returns the deltas of requests without an outbox."""
        scheduled = self.scheduler.schedule()
        if not scheduled:
            return []
        try:
            logits, proposals, masks = self._run(scheduled)
        except Exception as exc:  # the step's requests cannot go on; the others can
            return self._fail([s.sequence.request for s in scheduled], "running the model step", exc)
        now = time.perf_counter()
        self.steps += 1
        return self._after_step(scheduled, logits, proposals, masks, now)

    def _run(self, scheduled: list[ScheduledSequence]) -> tuple[np.ndarray, list[Proposal], list[list | None]]:
        """The step's block copies, proposals and executor run: its logits."""
        copies = self.blocks.take_copies()
        if copies:
            self.executor.copy_blocks(copies)
            if self.draft is not None:  # the draft's pool mirrors the target's blocks
                self.draft.copy_blocks(copies)
        state_copies = self.blocks.take_state_copies()
        if state_copies:
            self.executor.copy_state_slots(state_copies)
        proposals, masks = self._propose(scheduled)
        slot_of = self.blocks.slot_of
        self.rollback = {
            s.sequence.seq_id: (s.sequence.num_computed, self.executor.save_states(slot_of(s.sequence.seq_id)))
            for s, p in zip(scheduled, proposals, strict=True)
            if p.tokens and self.executor.states
        }
        batch = StepBatch(
            tokens=[
                [*s.sequence.token_ids[s.sequence.num_computed : s.sequence.num_computed + s.num_tokens], *p.tokens]
                for s, p in zip(scheduled, proposals, strict=True)
            ],
            past_lens=[s.sequence.num_computed for s in scheduled],
            block_tables=[self.blocks.block_table(s.sequence.seq_id) for s in scheduled],
            num_logits=self._rows(scheduled, proposals),
            state_slots=[slot_of(s.sequence.seq_id) for s in scheduled] if self.executor.states else None,
            lora_slots=[s.sequence.request.lora_slot for s in scheduled] if self.executor.lora else None,
        )
        started = time.perf_counter()
        for item in scheduled:
            request = item.sequence.request
            if request.scheduled_at is None:
                request.scheduled_at = started
                item.sequence.cached_tokens = item.sequence.num_computed
        return self.executor.step(batch), proposals, masks

    def _after_step(
        self,
        scheduled: list[ScheduledSequence],
        logits: np.ndarray,
        proposals: list[Proposal],
        masks: list[list | None],
        now: float,
    ) -> list[GenerationDelta]:
        """Advance the scheduled sequences by what they computed; the ones whose prompt is done choose tokens (or,
        on an embedding model, are pooled)."""
        counts = self._rows(scheduled, proposals)
        ends = np.cumsum(counts).tolist()
        choices: list[Choice] = []
        pooled: list[GenerationDelta] = []
        for item, proposal, mask, end, count in zip(scheduled, proposals, masks, ends, counts, strict=True):
            sequence: RequestSequence = item.sequence  # type: ignore[assignment]
            request = sequence.request
            if sequence.num_computed < sequence.prompt_len:
                self.prompt_tokens += min(item.num_tokens, sequence.prompt_len - sequence.num_computed)
            sequence.num_computed += item.num_tokens  # a proposal's tokens count once verified
            self.blocks.commit(sequence.seq_id, sequence.token_ids, sequence.num_computed)
            if self.pooling is not None:
                pooled += self._pool(sequence, logits[end - count : end], item.num_tokens, now)
                continue
            if sequence.num_uncomputed:
                continue  # a prompt chunk: nothing to sample yet
            rows = logits[end - len(proposal.tokens) - 1 : end]
            choices.append(Choice(sequence, rows, proposal, mask))
            for fork in request.forks:  # the prompt is done: the other completions share its blocks
                self.blocks.fork(sequence.seq_id, fork.seq_id)
                fork.num_computed = sequence.num_computed
                self.scheduler.add_running(fork)
                choices.append(Choice(fork, rows, Proposal(), None))
            request.forks = []
        if not choices:
            return pooled
        return pooled + self._accept(choices, now)

    def _rows(self, scheduled: list[ScheduledSequence], proposals: list[Proposal]) -> list[int]:
        """The output rows each scheduled sequence takes from the step: its last token's and its proposal's (one
        for each guess), or on an embedding model pooling the mean, every token's of the chunk."""
        if self.pooling == "mean":
            return [item.num_tokens for item in scheduled]
        return [len(proposal.tokens) + 1 for proposal in proposals]

    def _pool(self, sequence: RequestSequence, rows: np.ndarray, computed: int, now: float) -> list[GenerationDelta]:
        """Take an embedding model's rows of a prompt chunk (`computed` tokens); once the prompt is done, its
        embedding: the last row or the mean of every row, L2-normalized. A sequence recomputed from its start
        (preempted) starts its sum again."""
        if self.pooling == "mean":
            start = sequence.num_computed - computed
            total = np.zeros(rows.shape[-1]) if start == 0 or sequence.pooled is None else sequence.pooled
            sequence.pooled = total + rows.astype(np.float64).sum(0)
        if sequence.num_uncomputed:
            return []
        vector = sequence.pooled / sequence.prompt_len if self.pooling == "mean" else rows[-1].astype(np.float64)
        vector = vector / max(float(np.linalg.norm(vector)), 1e-12)
        delta = self.outputs.embedded(sequence, vector, now)
        self._retire(sequence)
        self.finished["stop"] += 1
        request = sequence.request
        if request.outbox is None and request.done:
            self.requests.pop(request.request_id, None)
        return deliver(request, delta)

    def _propose(self, scheduled: list[ScheduledSequence]) -> tuple[list[Proposal], list[list | None]]:
        """Each scheduled sequence's speculative tokens (none for prompt chunks, or without a proposer), and for
        constrained ones the grammar's mask at each position; a guess the grammar refuses ends its proposal. A
        sequence proposes at most one guess more than its last proposal kept: verifying a guess is not free (on
        this CPU each extra row of a step costs ~20% of a decode step), so one whose guesses miss drops to one."""
        proposals = [Proposal() for _ in scheduled]
        masks: list[list | None] = [None] * len(scheduled)
        if self.proposer is None:
            return proposals, masks
        picked = [i for i, item in enumerate(scheduled) if item.num_lookahead]
        sequences: list[RequestSequence] = [scheduled[i].sequence for i in picked]  # type: ignore[misc]
        limits = [  # no guess beyond what max_tokens still lets the sequence emit (a bonus token follows them)
            min(scheduled[i].num_lookahead, s.lookahead, s.sampling.params.max_tokens - len(s.output) - 1)
            for i, s in zip(picked, sequences, strict=True)
        ]
        for i, sequence, proposal in zip(picked, sequences, self.proposer.propose(sequences, limits), strict=True):
            proposals[i] = proposal
            if sequence.constraint is not None:
                masks[i], kept = sequence.constraint.masks_along(proposal.tokens)
                proposal.truncate(kept)
        return proposals, masks

    def _accept(self, choices: list[Choice], now: float) -> list[GenerationDelta]:
        """Choose each sequence's next tokens (sample, or verify its proposal) and stream them; finished
        sequences leave the batch. A request whose tokens cannot be chosen or streamed fails alone."""
        emitted, failed = choose_tokens(self.sampler, choices, self.speculation)
        returned: list[GenerationDelta] = []
        for choice, tokens in zip(choices, emitted, strict=True):
            if tokens is None or choice.sequence.request.done:  # failed, or its request failed with another choice
                continue
            try:
                returned += self._stream(choice, tokens, now)
            except Exception as exc:
                failed.append((choice, exc))
        for choice, exc in failed:
            returned += self._fail([choice.sequence.request], "choosing its tokens", exc)
        return returned

    def _stream(self, choice: Choice, tokens: Chosen, now: float) -> list[GenerationDelta]:
        """Append a choice's tokens to its sequence and stream them (to its caller's outbox, or returned)."""
        returned: list[GenerationDelta] = []
        sequence = choice.sequence
        for token, logprob in tokens:
            returned += deliver(sequence.request, self._emit(sequence, token, logprob, now))
            if sequence.finished:
                break
        if choice.proposal.tokens and not sequence.finished:  # the kept guesses' KV stays; the rest goes
            sequence.num_computed = len(sequence.token_ids) - 1
            saved = self.rollback.pop(sequence.seq_id, None)
            if saved is not None and len(tokens) <= len(choice.proposal.tokens):  # the state took in a rejected guess
                past, states = saved
                self.executor.restore_states(self.blocks.slot_of(sequence.seq_id), states)
                sequence.num_computed = past  # its kept tokens run again from the state before the guesses
            self.blocks.commit(sequence.seq_id, sequence.token_ids, sequence.num_computed)
            self.blocks.truncate(sequence.seq_id, len(sequence.token_ids))
        if self.proposer is not None and not sequence.finished:  # a draft may hold guesses the grammar cut
            self.proposer.verified(sequence)
        request = sequence.request
        if request.outbox is None and request.done:
            self.requests.pop(request.request_id, None)
        return returned

    def _fail(self, requests: Iterable[Request], doing: str, exc: Exception) -> list[GenerationDelta]:
        """End each of `requests` (once) with an error delta saying what the engine was doing, freeing its blocks;
        the exception and its traceback go to the log, not to the request's caller."""
        failed = list({r.request_id: r for r in requests if not r.done}.values())
        if not failed:
            return []
        logger.error("requests %s failed while %s", ", ".join(r.request_id for r in failed), doing, exc_info=exc)
        returned: list[GenerationDelta] = []
        for request in failed:
            error = f"the engine failed while {doing} (the details are in its log)"
            delta = GenerationDelta(0, 0, "", -1, "error", request_id=request.request_id, error=error)
            self.abort(request.request_id, "error")
            returned += deliver(request, delta)
        return returned

    def _emit(self, sequence: RequestSequence, token: int, logprob: TokenLogprob | None, now: float) -> GenerationDelta:
        """Append one chosen token to a sequence and stream it; a finished sequence leaves the batch."""
        sequence.token_ids.append(token)
        self.generation_tokens += 1
        if sequence.constraint is not None:
            sequence.constraint.accept(token)
        out = self.outputs.process(sequence, token, logprob, now)
        if out.result is not None:
            self._retire(sequence)
            self.finished[out.result.finish_reason] += 1
        return out

    def _retire(self, sequence: RequestSequence) -> None:
        """A finished or aborted sequence gives back its blocks and the proposer's state of it."""
        self.scheduler.remove(sequence)
        if self.proposer is not None:
            self.proposer.finished(sequence.seq_id)
        self._release_adapter(sequence.request)

    def _release_adapter(self, request: Request) -> None:
        """A request that is done gives its LoRA adapter's slot back (once)."""
        if request.done and request.lora_slot >= 0:
            self.adapters.release(request.lora_slot)
            request.lora_slot = -1
