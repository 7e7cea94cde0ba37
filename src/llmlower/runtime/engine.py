"""Engine: turns prompts into completions with an executor, the scheduler, the sampler and the detokenizer.

Requests arrive at any time (`add_request`); each `step()` lets the scheduler pick the sequences to run
(continuous batching with chunked prefill, admission by free KV blocks, preemption by recompute), runs them
as one executor step, samples every sequence whose prompt is done and streams its text through stop
handling. A request with n > 1 completions prefills its prompt once; the other completions then share its
blocks. `generate` and `stream` are built on these calls, so several of them (interleaved generators, or
callers of add_request) share the engine's batch. One thread drives an engine at a time (AsyncEngine runs
it in a thread of its own for asyncio servers).
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import GenerationError, RequestFailed
from ..spec import ModelSpec
from ..step_io import DEFAULT_BLOCK_SIZE
from .artifact import draft_artifact, kv_cache_dtype, read_manifest
from .block_manager import BlockManager, kv_pool_blocks
from .detokenizer import StreamDelta, TextStream
from .executor import Executor, StepBatch
from .executors import load_executor
from .proposers import make_proposer
from .sampling import Sampler, SamplingParams, SequenceSampling
from .scheduler import ScheduledSequence, Scheduler
from .scheduler import Sequence as SchedulerSequence
from .speculative import Proposal, SpeculationStats, SpeculativeConfig, verify
from .structured import Constraint, GrammarCompiler, StructuredOutput
from .tokenizer import Message, Tokenizer
from .weights import WeightSource

Prompt = str | list[Message]
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineConfig:
    """Serving limits: sequences per step, tokens per step (prompt chunks and decodes together), the longest
    sequence, and the KV pool (`num_blocks` or `kv_cache_memory` bytes; default: every sequence can reach
    max_context). `block_size` of a paged artifact is fixed when compiling."""

    max_num_seqs: int = 16
    max_num_batched_tokens: int = 128  # CPU: a step's prompt chunk stays short (benchmarks/serving.py in README)
    max_context: int | None = 2048
    block_size: int | None = None
    num_blocks: int | None = None
    kv_cache_memory: int | None = None
    enable_prefix_caching: bool = True
    speculative: SpeculativeConfig | None = None  # speculative decoding: the proposer and its tokens per step


@dataclass
class Timing:
    ttft_s: float = 0.0  # from the request's arrival to its first token
    decode_tokens_per_s: float = 0.0  # tokens after the first, over the time they took
    mean_token_latency_s: float = 0.0  # average time between consecutive tokens after the first
    total_s: float = 0.0  # from arrival to the last token
    queue_s: float = 0.0  # from arrival to the first step that ran it
    inter_token_latencies_s: list[float] = field(default_factory=list)


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


@dataclass
class TokenLogprob:
    """A chosen token's logprob and the most likely alternatives, from the distribution it was drawn from."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class GenerationResult:
    """One completion: request `request` (its position in a generate call), completion `index` of its n."""

    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    finish_reason: str  # "stop" (EOS, a stop token or a stop string) or "length" (max_tokens or the context)
    stop: str | int | None = None  # the stop string or token that ended it
    logprobs: list[TokenLogprob] | None = None
    usage: Usage | None = None
    timing: Timing = field(default_factory=Timing)
    request: int = 0
    index: int = 0
    request_id: str = ""
    speculation: dict[str, Any] | None = None  # with speculative decoding: SpeculationStats.to_dict of this one

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class GenerationDelta:
    """What one step added to a completion, for streaming: `text` may be empty while characters or a
    possible stop string are held back; the last delta of a completion has `finish_reason` and `result` set."""

    request: int  # position in a generate/stream call (0 for add_request)
    index: int
    text: str
    token_id: int
    finish_reason: str | None = None
    logprob: TokenLogprob | None = None
    request_id: str = ""
    result: GenerationResult | None = None
    error: str | None = None  # the engine failed the request (finish_reason "error"); what it was doing


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


@dataclass(eq=False)
class _Sequence(SchedulerSequence):
    request: _Request | None = None
    index: int = 0
    sampling: SequenceSampling | None = None
    stream: TextStream | None = None
    constraint: Constraint | None = None  # its structured output's grammar state
    speculation: SpeculationStats = field(default_factory=SpeculationStats)
    lookahead: int = 1 << 30  # guesses worth proposing: one more than its last proposal kept (see _propose)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    cached_tokens: int = 0
    finished: bool = False

    @property
    def output(self) -> list[int]:
        return self.token_ids[self.prompt_len :]


@dataclass(eq=False)
class _Request:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    arrival: float
    sequences: list[_Sequence] = field(default_factory=list)
    forks: list[_Sequence] = field(default_factory=list)  # completions waiting for the first one's prompt
    scheduled_at: float | None = None
    outbox: deque[GenerationDelta] | None = None  # deltas kept for a generate/stream call, else step() returns them

    @property
    def done(self) -> bool:
        return all(s.finished for s in self.sequences)


@dataclass
class _Choice:
    """A sequence whose next tokens are chosen this step: its logits rows (one, or one per proposed token plus
    one), its proposal, and the grammar's masks along it."""

    sequence: _Sequence
    logits: np.ndarray
    proposal: Proposal
    masks: list[np.ndarray | None] | None


class Engine:
    def __init__(
        self,
        executor: Executor,
        tokenizer: Tokenizer,
        spec: ModelSpec,
        seed: int | None = None,
        config: EngineConfig | None = None,
        draft: Executor | None = None,
    ) -> None:
        """`draft`: the draft model's executor when config.speculative uses one (a pool of the target's shape)."""
        config = config or EngineConfig()
        self.executor = executor
        self.tokenizer = tokenizer
        self.spec = spec
        self.config = config
        self.eos_token_ids = frozenset(spec.eos_token_ids)
        self.sampler = Sampler(self.eos_token_ids, np.random.default_rng(seed))
        self.blocks = BlockManager(
            executor.num_blocks, executor.block_size, config.enable_prefix_caching, executor.blocks_per_slot
        )
        speculative = config.speculative
        lookahead = speculative.num_tokens if speculative else 0
        self.scheduler = Scheduler(
            self.blocks, config.max_num_seqs, config.max_num_batched_tokens, lookahead, executor.max_context
        )
        self.draft = draft
        self.proposer = make_proposer(speculative, draft, executor, self.sampler, self.blocks.block_table)
        self.speculation = SpeculationStats()
        self.requests: dict[str, _Request] = {}
        self._sequence_ids = itertools.count()
        self._request_ids = itertools.count()
        self._driver = threading.Lock()
        self._grammars: GrammarCompiler | None = None  # built for the first request with structured output
        self._grammars_built = threading.Lock()
        self.prompt_tokens = self.generation_tokens = self.steps = 0
        self.finished: Counter[str] = Counter()

    @classmethod
    def load(
        cls,
        artifact: str | Path,
        config: EngineConfig | None = None,
        threads: int = 0,
        weights: str = "auto",
        weights_seed: int = 0,
        **limits: int | bool | None,
    ) -> Engine:
        """An Engine on a compiled artifact (code: TVM's model.so and MLIR modules run natively in this process, so
        only artifacts you trust); needs only numpy, tokenizers, jinja2 and the backend's runtime.
        `config` or EngineConfig's fields as keywords (max_num_seqs=4, max_context=512, ...) set its limits.
        `weights`: "auto" reads the artifact's weights file; "random" makes up every weight the manifest lists
        from `weights_seed` instead (dummy weights, for speed runs where the weights file is absent)."""
        source = WeightSource(weights, weights_seed)
        config = config or EngineConfig(**limits)
        artifact = Path(artifact)
        manifest = read_manifest(artifact, weights=not source.random)
        spec = ModelSpec.from_dict(manifest["spec"])
        context = min(config.max_context or spec.max_positions, spec.max_positions)
        compiled_block_size = manifest["kv_layout"].get("block_size")
        if config.block_size and compiled_block_size and config.block_size != compiled_block_size:
            raise GenerationError(
                f"--block-size {config.block_size}: {artifact} was compiled for {compiled_block_size}"
            )
        block_size = compiled_block_size or config.block_size or DEFAULT_BLOCK_SIZE
        num_blocks = kv_pool_blocks(
            spec.kv_bytes_per_token(kv_cache_dtype(manifest)),
            block_size,
            config.max_num_seqs,
            context,
            config.num_blocks,
            config.kv_cache_memory,
            on_host=manifest["target"] == "cpu",
        )
        executor = load_executor(artifact, manifest, num_blocks, block_size, context, threads, source)
        tokenizer = Tokenizer.from_dir(artifact)
        draft = None
        speculative = config.speculative
        if speculative is not None and speculative.method != "ngram":
            path = (
                speculative.draft
                if speculative.method == "draft"
                else draft_artifact(artifact, speculative.layers, weights=not source.random)
            )
            draft_manifest = read_manifest(path, weights=not source.random)
            same_logits = ModelSpec.from_dict(draft_manifest["spec"]).vocab_size == spec.vocab_size
            if not same_logits or Tokenizer.from_dir(path).vocabulary() != tokenizer.vocabulary():
                raise GenerationError(f"draft model {path}: its tokenizer or vocabulary differs from {artifact}'s")
            draft = load_executor(path, draft_manifest, num_blocks, block_size, context, threads, source)
        return cls(executor, tokenizer, spec, config=config, draft=draft)

    # ---------------------------------------------------------------- requests

    def prompt_token_ids(self, prompt: Prompt, chat: bool = True) -> list[int]:
        """Token ids of a prompt: a string through the chat template (unless chat=False), or a conversation."""
        if isinstance(prompt, list):
            text = self.tokenizer.apply_chat_template(prompt)
            return self.tokenizer.encode(text, add_special_tokens=False)
        if chat:
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
            return self.tokenizer.encode(text, add_special_tokens=False)
        return self.tokenizer.encode(prompt, add_special_tokens=True)

    def add_request(
        self,
        prompt: Prompt | list[int],
        params: SamplingParams | None = None,
        chat: bool = True,
        request_id: str | None = None,
    ) -> str:
        """Queue a request (a prompt, a conversation, or token ids); returns its id. Its deltas come from step()."""
        with self._driving():
            return self._add(prompt, params or SamplingParams(), chat, request_id, None, "prompt").request_id

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its KV blocks; False if it is unknown or already finished."""
        with self._driving():
            return self._abort(request_id)

    def has_unfinished(self) -> bool:
        return any(not request.done for request in self.requests.values())

    def step(self) -> list[GenerationDelta]:
        """Run one step of every scheduled sequence; returns the deltas of requests added with add_request
        (those of generate/stream calls go to their callers)."""
        with self._driving():
            return self._step()

    def stats(self) -> EngineStats:
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
        )

    # ---------------------------------------------------------------- batch calls

    def generate(
        self,
        prompts: Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        chat: bool = True,
    ) -> list[GenerationResult]:
        """Completions of `prompts` (one SamplingParams for all, or one each), ordered by request, then index."""
        results = [delta.result for delta in self.stream(prompts, params, chat) if delta.result is not None]
        return sorted(results, key=lambda r: (r.request, r.index))

    def stream(
        self,
        prompts: Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        chat: bool = True,
    ) -> Iterator[GenerationDelta]:
        """The deltas of every completion as they are produced; each completion's texts add up to its text.
        Requests still running when the caller stops listening are aborted."""
        params = params_per_prompt(prompts, params)
        with self._driving():
            pairs = list(zip(prompts, params, strict=True))
            encoded = [self._checked_prompt(p, chat, f"prompts[{i}]", sp) for i, (p, sp) in enumerate(pairs)]
            requests = [self._add(ids, sp, False, None, deque(), "") for ids, sp in zip(encoded, params, strict=True)]
        try:
            while True:
                while any(request.outbox for request in requests):  # another generator may step while we yield
                    for position, request in enumerate(requests):
                        while request.outbox:
                            delta = request.outbox.popleft()
                            if delta.error is not None:
                                raise RequestFailed(delta.error)
                            if delta.result is not None:
                                delta.result.request = position
                            yield replace(delta, request=position)
                if all(request.done for request in requests):
                    return
                self.step()
        finally:
            with self._driving():
                for request in requests:
                    self._abort(request.request_id)
                    self.requests.pop(request.request_id, None)

    # ---------------------------------------------------------------- internals

    @contextlib.contextmanager
    def _driving(self) -> Iterator[None]:
        """One thread at a time: a second one gets an error instead of corrupting the batch."""
        if not self._driver.acquire(blocking=False):
            raise GenerationError(
                "this Engine is being driven by another thread; drive it from one thread (or use AsyncEngine)"
            )
        try:
            yield
        finally:
            self._driver.release()

    def _checked_prompt(self, prompt: Prompt | list[int], chat: bool, label: str, params: SamplingParams) -> list[int]:
        """The prompt's token ids, refused when the engine could never serve it."""
        if isinstance(prompt, list) and not prompt:  # neither token ids nor messages: no empty chat is made of it
            raise GenerationError(f"{label} is empty", label)
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            ids = list(prompt)
        else:
            ids = self.prompt_token_ids(prompt, chat)
        if not ids:
            raise GenerationError(f"{label} is empty after tokenization", label)
        if len(ids) >= self.executor.max_context:
            context = self.executor.max_context
            raise GenerationError(f"{label} has {len(ids)} tokens; the context holds {context}", label)
        vocab = self.spec.vocab_size
        named = {label: ids, "stop_token_ids": params.stop_token_ids, "logit_bias": list(params.logit_bias)}
        for name, tokens in named.items():  # checked now: a bad id found mid-step would fail the whole batch
            bad = [t for t in tokens if not 0 <= t < vocab]
            if bad:
                raise GenerationError(f"{name} has token id {bad[0]}; the vocabulary has {vocab} tokens", name)
        if params.n > self.config.max_num_seqs:
            raise GenerationError(f"n={params.n} exceeds max_num_seqs={self.config.max_num_seqs}", "n")
        if self.executor.blocks_per_slot and params.n > self.blocks.num_slots:
            raise GenerationError(f"n={params.n} exceeds the {self.blocks.num_slots} sequences the KV pool holds", "n")
        if self.blocks.blocks_needed(len(ids) + 1) > self.executor.num_blocks:
            blocks = self.executor.num_blocks
            raise GenerationError(f"{label} has {len(ids)} tokens; the KV pool holds {blocks} blocks", label)
        if params.structured_output is not None:
            self._grammar_compiler().check(params.structured_output)
        return ids

    def compile_grammar(self, output: StructuredOutput) -> None:
        """Compile a structured output now, from any thread (a server's worker), so that adding a request that asks
        for it finds it compiled; a bad one raises here."""
        self._grammar_compiler().check(output)

    def _grammar_compiler(self) -> GrammarCompiler:
        """The compiler of structured outputs for this model's tokenizer, built on first use (needs llguidance)."""
        with self._grammars_built:
            if self._grammars is None:
                self._grammars = GrammarCompiler(self.tokenizer.to_json(), self.spec.vocab_size, self.eos_token_ids)
        return self._grammars

    def _add(
        self,
        prompt: Prompt | list[int],
        params: SamplingParams,
        chat: bool,
        request_id: str | None,
        outbox: deque | None,
        label: str,
    ) -> _Request:
        ids = prompt if not label else self._checked_prompt(prompt, chat, label, params)
        request_id = request_id or f"req-{next(self._request_ids)}"
        if request_id in self.requests:
            raise GenerationError(f"request_id {request_id!r} is already in use")
        request = _Request(request_id, list(ids), params, time.perf_counter(), outbox=outbox)
        output = params.structured_output
        constraints = [None] * params.n if output is None else self._grammar_compiler().constraints(output, params.n)
        for index, constraint in enumerate(constraints):
            sequence = _Sequence(
                seq_id=next(self._sequence_ids),
                token_ids=list(ids),
                prompt_len=len(ids),
                width=params.n if index == 0 else 1,
                request=request,
                index=index,
                sampling=SequenceSampling(params, index),
                stream=self._text_stream(params),
                constraint=constraint,
            )
            request.sequences.append(sequence)
        request.forks = request.sequences[1:]
        self.scheduler.add(request.sequences[0])
        self.requests[request_id] = request
        return request

    def _text_stream(self, params: SamplingParams) -> TextStream:
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids))
        return TextStream(
            self.tokenizer,
            stop=params.stop,
            stop_token_ids=stop_ids,
            max_tokens=params.max_tokens,
            include_stop_str_in_output=params.include_stop_str_in_output,
        )

    def _abort(self, request_id: str, reason: str = "abort") -> bool:
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
        if request.outbox is None:
            del self.requests[request_id]
        return True

    def _step(self) -> list[GenerationDelta]:
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
        proposals, masks = self._propose(scheduled)
        batch = StepBatch(
            tokens=[
                [*s.sequence.token_ids[s.sequence.num_computed : s.sequence.num_computed + s.num_tokens], *p.tokens]
                for s, p in zip(scheduled, proposals, strict=True)
            ],
            past_lens=[s.sequence.num_computed for s in scheduled],
            block_tables=[self.blocks.block_table(s.sequence.seq_id) for s in scheduled],
            num_logits=[len(p.tokens) + 1 for p in proposals],
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
        """Advance the scheduled sequences by what they computed; the ones whose prompt is done choose tokens."""
        ends = np.cumsum([len(p.tokens) + 1 for p in proposals])
        choices: list[_Choice] = []
        for item, proposal, mask, end in zip(scheduled, proposals, masks, ends.tolist(), strict=True):
            sequence: _Sequence = item.sequence  # type: ignore[assignment]
            request = sequence.request
            if sequence.num_computed < sequence.prompt_len:
                self.prompt_tokens += min(item.num_tokens, sequence.prompt_len - sequence.num_computed)
            sequence.num_computed += item.num_tokens  # a proposal's tokens count once verified
            self.blocks.commit(sequence.seq_id, sequence.token_ids, sequence.num_computed)
            if sequence.num_uncomputed:
                continue  # a prompt chunk: nothing to sample yet
            rows = logits[end - len(proposal.tokens) - 1 : end]
            choices.append(_Choice(sequence, rows, proposal, mask))
            for fork in request.forks:  # the prompt is done: the other completions share its blocks
                self.blocks.fork(sequence.seq_id, fork.seq_id)
                fork.num_computed = sequence.num_computed
                self.scheduler.add_running(fork)
                choices.append(_Choice(fork, rows, Proposal(), None))
            request.forks = []
        if not choices:
            return []
        return self._accept(choices, now)

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
        sequences: list[_Sequence] = [scheduled[i].sequence for i in picked]  # type: ignore[misc]
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

    def _accept(self, choices: list[_Choice], now: float) -> list[GenerationDelta]:
        """Choose each sequence's next tokens (sample, or verify its proposal) and stream them; finished
        sequences leave the batch. A request whose tokens cannot be chosen or streamed fails alone."""
        emitted, failed = self._chosen(choices)
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

    def _chosen(self, choices: list[_Choice]) -> tuple[list[list | None], list[tuple[_Choice, Exception]]]:
        """Each choice's (token, logprob) pairs, chosen together; when that fails, each is chosen alone, so only
        the choices that fail alone fail (None, with their exception)."""
        try:
            return self._choose(choices), []
        except Exception as exc:
            if len(choices) == 1:
                return [None], [(choices[0], exc)]
        emitted: list[list | None] = []
        failed: list[tuple[_Choice, Exception]] = []
        for choice in choices:
            tokens, error = self._chosen([choice])
            emitted += tokens
            failed += error
        return emitted, failed

    def _choose(self, choices: list[_Choice]) -> list[list[tuple[int, TokenLogprob | None]]]:
        """Sample the plain choices and verify the speculative ones, in one batch each."""
        emitted: list[list[tuple[int, TokenLogprob | None]]] = [[] for _ in choices]
        plain = [i for i, c in enumerate(choices) if not c.proposal.tokens]
        if plain:
            sequences = [choices[i].sequence for i in plain]
            chosen = self.sampler.sample(
                np.concatenate([choices[i].logits for i in plain]),
                [s.sampling for s in sequences],
                [s.token_ids[: s.prompt_len] for s in sequences],
                [s.output for s in sequences],
                [s.constraint.mask() if s.constraint is not None else None for s in sequences],
            )
            for row, i in enumerate(plain):
                token, logprob = int(chosen.token_ids[row]), chosen.logprobs[row]
                top = chosen.top_logprobs[row] or []
                emitted[i] = [(token, None if logprob is None else TokenLogprob(token, logprob, top))]
        speculated = [i for i, c in enumerate(choices) if c.proposal.tokens]
        if speculated:
            picked = [choices[i] for i in speculated]
            verified = verify(
                self.sampler,
                np.concatenate([c.logits for c in picked]),
                [c.proposal for c in picked],
                [c.sequence.sampling for c in picked],
                [c.sequence.token_ids[: c.sequence.prompt_len] for c in picked],
                [c.sequence.output for c in picked],
                None if all(c.masks is None for c in picked) else [c.masks or [None] * len(c.logits) for c in picked],
            )
            for i, choice, result in zip(speculated, picked, verified, strict=True):
                choice.sequence.speculation.record(len(choice.proposal.tokens), result.accepted)
                choice.sequence.lookahead = result.accepted + 1  # grows while guesses are kept, 1 after a miss
                self.speculation.record(len(choice.proposal.tokens), result.accepted)
                logprobs = result.logprobs or [None] * len(result.tokens)
                tops = result.top_logprobs or [[]] * len(result.tokens)
                emitted[i] = [
                    (t, None if lp is None else TokenLogprob(t, lp, top))
                    for t, lp, top in zip(result.tokens, logprobs, tops, strict=True)
                ]
        return emitted

    def _stream(self, choice: _Choice, tokens: list, now: float) -> list[GenerationDelta]:
        """Append a choice's tokens to its sequence and stream them (to its caller's outbox, or returned)."""
        returned: list[GenerationDelta] = []
        sequence = choice.sequence
        for token, logprob in tokens:
            out = self._emit(sequence, token, logprob, now)
            if sequence.request.outbox is not None:
                sequence.request.outbox.append(out)
            else:
                returned.append(out)
            if sequence.finished:
                break
        if choice.proposal.tokens and not sequence.finished:  # the kept guesses' KV stays; the rest goes
            sequence.num_computed = len(sequence.token_ids) - 1
            self.blocks.commit(sequence.seq_id, sequence.token_ids, sequence.num_computed)
            self.blocks.truncate(sequence.seq_id, len(sequence.token_ids))
        if self.proposer is not None and not sequence.finished:  # a draft may hold guesses the grammar cut
            self.proposer.verified(sequence)
        request = sequence.request
        if request.outbox is None and request.done:
            self.requests.pop(request.request_id, None)
        return returned

    def _fail(self, requests: Iterable[_Request], doing: str, exc: Exception) -> list[GenerationDelta]:
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
            self._abort(request.request_id, "error")
            if request.outbox is not None:
                request.outbox.append(delta)
            else:
                returned.append(delta)
        return returned

    def _emit(self, sequence: _Sequence, token: int, logprob: TokenLogprob | None, now: float) -> GenerationDelta:
        """Append one chosen token to a sequence and stream it; a finished sequence leaves the batch."""
        sequence.token_ids.append(token)
        sequence.token_times.append(now)
        self.generation_tokens += 1
        if logprob is not None:
            sequence.logprobs.append(logprob)
        if sequence.constraint is not None:
            sequence.constraint.accept(token)
        delta = sequence.stream.add(token)
        if not delta.finished and sequence.constraint is not None and sequence.constraint.finished:
            delta = _joined(delta, sequence.stream.finish("stop"))  # a grammar may end without EOS
        if not delta.finished and len(sequence.token_ids) >= self.executor.max_context:
            delta = _joined(delta, sequence.stream.finish("length"))
        request = sequence.request
        out = GenerationDelta(0, sequence.index, delta.text, token, delta.finish_reason, logprob, request.request_id)
        if delta.finished:
            sequence.finished = True
            self._retire(sequence)
            out.result = self._result(sequence)
            self.finished[out.result.finish_reason] += 1
        return out

    def _retire(self, sequence: _Sequence) -> None:
        """A finished or aborted sequence gives back its blocks and the proposer's state of it."""
        self.scheduler.remove(sequence)
        if self.proposer is not None:
            self.proposer.finished(sequence.seq_id)

    def _result(self, sequence: _Sequence) -> GenerationResult:
        request = sequence.request
        times = sequence.token_times
        gaps = np.diff(times).tolist()
        decode_time = times[-1] - times[0]
        timing = Timing(
            ttft_s=times[0] - request.arrival,
            decode_tokens_per_s=len(gaps) / decode_time if decode_time > 0 else 0.0,
            mean_token_latency_s=decode_time / len(gaps) if gaps else 0.0,
            total_s=times[-1] - request.arrival,
            queue_s=(request.scheduled_at or times[0]) - request.arrival,
            inter_token_latencies_s=gaps,
        )
        output = sequence.output
        usage = Usage(sequence.prompt_len, len(output), sequence.prompt_len + len(output), sequence.cached_tokens)
        return GenerationResult(
            text=sequence.stream.text,
            token_ids=list(output),
            prompt_token_ids=request.prompt,
            finish_reason=sequence.stream.finish_reason or "length",
            stop=sequence.stream.matched_stop,
            logprobs=sequence.logprobs if request.params.logprobs else None,
            usage=usage,
            timing=timing,
            index=sequence.index,
            request_id=request.request_id,
            speculation=sequence.speculation.to_dict() if self.proposer is not None else None,
        )


def params_per_prompt(
    prompts: Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None
) -> list[SamplingParams]:
    """One SamplingParams per prompt of a generate/stream call (given once for all, or one each)."""
    if isinstance(prompts, str):
        raise GenerationError("prompts must be a list of prompts (a str or a list of messages each)")
    if params is None or isinstance(params, SamplingParams):
        return [params or SamplingParams()] * len(prompts)
    if len(params) != len(prompts):
        raise GenerationError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
    return list(params)


def _joined(first: StreamDelta, second: StreamDelta) -> StreamDelta:
    """Two deltas of one step as one (the token's text, then what the grammar's end or the context limit
    released)."""
    return StreamDelta(first.text + second.text, second.finished, second.finish_reason, second.stop)
