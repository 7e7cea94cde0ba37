"""Engine: turns prompts into completions with an executor, the sampler and the streaming detokenizer.

Requests are run in waves of up to `executor.max_batch` sequences (a request with n > 1 is n sequences):
one batched prefill over prompts of different lengths, then batched decode steps over the sequences still
running; each step samples every sequence at once and streams its text through stop handling.
(Continuous batching, admitting requests between steps, comes with the paged KV cache.)
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import GenerationError
from ..spec import ModelSpec
from .artifact import read_manifest
from .detokenizer import StreamDelta, TextStream
from .executor import Executor, StepBatch
from .executors import load_executor
from .sampling import Sampler, SamplingParams, SequenceSampling
from .tokenizer import Message, Tokenizer

Prompt = str | list[Message]


@dataclass
class Timing:
    ttft_s: float = 0.0  # from the call to the request's first token
    decode_tokens_per_s: float = 0.0  # tokens after the first, over the time they took
    mean_token_latency_s: float = 0.0  # average time between consecutive tokens after the first
    total_s: float = 0.0


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


@dataclass
class TokenLogprob:
    """A chosen token's logprob and the most likely alternatives, from the distribution it was drawn from."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class GenerationResult:
    """One completion: request `request` (its position in the call), completion `index` of its n."""

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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class GenerationDelta:
    """What one step added to a completion, for streaming: `text` may be empty while characters or a
    possible stop string are held back; the last delta of a completion has `finish_reason` set."""

    request: int
    index: int
    text: str
    token_id: int
    finish_reason: str | None = None
    logprob: TokenLogprob | None = None


@dataclass
class _Sequence:
    request: int
    prompt: list[int]
    sampling: SequenceSampling
    stream: TextStream
    slot: int = -1
    output: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    first_token_at: float = 0.0
    last_token_at: float = 0.0


class Engine:
    def __init__(self, executor: Executor, tokenizer: Tokenizer, spec: ModelSpec, seed: int | None = None) -> None:
        self.executor = executor
        self.tokenizer = tokenizer
        self.spec = spec
        self.eos_token_ids = frozenset(spec.eos_token_ids)
        self.sampler = Sampler(self.eos_token_ids, np.random.default_rng(seed))

    @classmethod
    def load(cls, artifact: str | Path, max_batch: int = 4, max_context: int | None = 2048, threads: int = 0) -> Engine:
        """An Engine on a compiled artifact; needs only numpy, tokenizers, jinja2 and the backend's runtime."""
        artifact = Path(artifact)
        manifest = read_manifest(artifact)
        spec = ModelSpec.from_dict(manifest["spec"])
        context = min(max_context or spec.max_positions, spec.max_positions)
        executor = load_executor(artifact, manifest, max_batch, context, threads)
        return cls(executor, Tokenizer.from_dir(artifact), spec)

    def prompt_token_ids(self, prompt: Prompt, chat: bool = True) -> list[int]:
        """Token ids of a prompt: a string through the chat template (unless chat=False), or a conversation."""
        if isinstance(prompt, list):
            text = self.tokenizer.apply_chat_template(prompt)
            return self.tokenizer.encode(text, add_special_tokens=False)
        if chat:
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
            return self.tokenizer.encode(text, add_special_tokens=False)
        return self.tokenizer.encode(prompt, add_special_tokens=True)

    def generate(
        self,
        prompts: Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        chat: bool = True,
    ) -> list[GenerationResult]:
        """Completions of `prompts` (one SamplingParams for all, or one each), ordered by request, then index."""
        started = time.perf_counter()
        sequences = self._sequences(prompts, params, chat)
        for _ in self._run(sequences):
            pass
        return [self._result(seq, started) for seq in sequences]

    def stream(
        self,
        prompts: Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        chat: bool = True,
    ) -> Iterator[GenerationDelta]:
        """The deltas of every completion as they are produced; each completion's texts add up to its text."""
        yield from self._run(self._sequences(prompts, params, chat))

    def _sequences(
        self, prompts: Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None, chat: bool
    ) -> list[_Sequence]:
        if isinstance(prompts, str):
            raise GenerationError("prompts must be a list of prompts (a str or a list of messages each)")
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise GenerationError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
        sequences = []
        for request, (prompt, request_params) in enumerate(zip(prompts, params, strict=True)):
            ids = self.prompt_token_ids(prompt, chat)
            if not ids:
                raise GenerationError(f"prompts[{request}] is empty after tokenization")
            if len(ids) >= self.executor.max_context:
                raise GenerationError(
                    f"prompts[{request}] has {len(ids)} tokens; the context holds {self.executor.max_context}"
                )
            for index in range(request_params.n):
                sequences.append(
                    _Sequence(request, ids, SequenceSampling(request_params, index), self._text_stream(request_params))
                )
        return sequences

    def _text_stream(self, params: SamplingParams) -> TextStream:
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids))
        return TextStream(
            self.tokenizer,
            stop=params.stop,
            stop_token_ids=stop_ids,
            max_tokens=params.max_tokens,
            include_stop_str_in_output=params.include_stop_str_in_output,
        )

    def _run(self, sequences: list[_Sequence]) -> Iterator[GenerationDelta]:
        wave = self.executor.max_batch
        for start in range(0, len(sequences), wave):
            yield from self._run_wave(sequences[start : start + wave])

    def _run_wave(self, wave: list[_Sequence]) -> Iterator[GenerationDelta]:
        for slot, seq in enumerate(wave):
            seq.slot = slot
        logits = self._prefill(wave)
        running = wave
        while True:
            running = yield from self._accept(running, logits)
            if not running:
                return
            batch = StepBatch(
                slots=[s.slot for s in running],
                tokens=[[s.output[-1]] for s in running],
                past_lens=[len(s.prompt) + len(s.output) - 1 for s in running],
            )
            logits = self.executor.step(batch)

    def _prefill(self, wave: list[_Sequence]) -> np.ndarray:
        """One prefill per request in the wave; its other completions fork the prompt's cache (n > 1 costs
        one prompt's prefill). Returns each sequence's logits."""
        leaders: dict[int, _Sequence] = {}
        for seq in wave:
            leaders.setdefault(seq.request, seq)
        firsts = list(leaders.values())
        logits = self.executor.step(StepBatch([s.slot for s in firsts], [s.prompt for s in firsts], [0] * len(firsts)))
        for seq in wave:
            if seq is not leaders[seq.request]:
                self.executor.fork(leaders[seq.request].slot, seq.slot, len(seq.prompt))
        row = {seq.request: index for index, seq in enumerate(firsts)}
        return logits[[row[seq.request] for seq in wave]]

    def _accept(self, sequences: list[_Sequence], logits: np.ndarray) -> Iterator[GenerationDelta]:
        """Sample each sequence's next token and stream it; returns the sequences that go on."""
        chosen = self.sampler.sample(
            logits, [s.sampling for s in sequences], [s.prompt for s in sequences], [s.output for s in sequences]
        )
        now = time.perf_counter()
        still_running = []
        for row, (seq, token) in enumerate(zip(sequences, chosen.token_ids.tolist(), strict=True)):
            seq.output.append(token)
            seq.first_token_at = seq.first_token_at or now
            seq.last_token_at = now
            logprob = None
            if chosen.logprobs[row] is not None:
                logprob = TokenLogprob(token, chosen.logprobs[row], chosen.top_logprobs[row] or [])
                seq.logprobs.append(logprob)
            delta = seq.stream.add(token)
            if not delta.finished and len(seq.prompt) + len(seq.output) >= self.executor.max_context:
                delta = _joined(delta, seq.stream.finish_length())
            if not delta.finished:
                still_running.append(seq)
            yield GenerationDelta(seq.request, seq.sampling.index, delta.text, token, delta.finish_reason, logprob)
        return still_running

    def _result(self, seq: _Sequence, started: float) -> GenerationResult:
        decode_time = seq.last_token_at - seq.first_token_at
        after_first = len(seq.output) - 1
        timing = Timing(
            ttft_s=seq.first_token_at - started,
            decode_tokens_per_s=after_first / decode_time if decode_time > 0 else 0.0,
            mean_token_latency_s=decode_time / after_first if after_first else 0.0,
            total_s=seq.last_token_at - started,
        )
        usage = Usage(len(seq.prompt), len(seq.output), len(seq.prompt) + len(seq.output))
        params = seq.sampling.params
        return GenerationResult(
            text=seq.stream.text,
            token_ids=seq.output,
            prompt_token_ids=seq.prompt,
            finish_reason=seq.stream.finish_reason or "length",
            stop=seq.stream.matched_stop,
            logprobs=seq.logprobs if params.logprobs else None,
            usage=usage,
            timing=timing,
            request=seq.request,
            index=seq.sampling.index,
        )


def _joined(first: StreamDelta, second: StreamDelta) -> StreamDelta:
    """Two deltas of one step as one (the token's text, then what the context limit released)."""
    return StreamDelta(first.text + second.text, second.finished, second.finish_reason, second.stop)
