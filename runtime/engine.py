"""Engine: turns prompts into completions with an executor, greedy decoding and EOS / length stops.

Requests are run in waves of up to `executor.max_batch`: one batched prefill over prompts of different
lengths, then batched decode steps over the sequences still running. (The sampler, continuous batching
and streaming arrive with later runtime work; this loop is what they plug into.)
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import GenerationError
from ..spec import ModelSpec
from .artifact import MANIFEST, ArtifactError, read_manifest
from .executor import Executor, StepBatch
from .tokenizer import Message, Tokenizer

Prompt = str | list[Message]


@dataclass
class Timing:
    ttft_s: float = 0.0  # from the call to the request's first token
    decode_tokens_per_s: float = 0.0  # tokens after the first, over the time they took
    total_s: float = 0.0


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    finish_reason: str  # "stop" (an EOS token) or "length" (max_tokens or the context)
    timing: Timing = field(default_factory=Timing)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class _Sequence:
    slot: int
    prompt: list[int]
    max_tokens: int
    output: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    first_token_at: float = 0.0
    last_token_at: float = 0.0


class Engine:
    def __init__(self, executor: Executor, tokenizer: Tokenizer, spec: ModelSpec) -> None:
        self.executor = executor
        self.tokenizer = tokenizer
        self.spec = spec
        self.eos_token_ids = frozenset(spec.eos_token_ids)

    @classmethod
    def load(cls, artifact: str | Path, max_batch: int = 4, max_context: int | None = 2048, threads: int = 0) -> Engine:
        """An Engine on a compiled artifact; needs only numpy, tokenizers, jinja2 and the backend's runtime."""
        artifact = Path(artifact)
        manifest = read_manifest(artifact)
        spec = ModelSpec.from_dict(manifest["spec"])
        context = min(max_context or spec.max_positions, spec.max_positions)
        if manifest.get("backend") != "onnx":
            raise ArtifactError(f"{artifact / MANIFEST}: backend {manifest.get('backend')!r} has no executor here")
        from .executors.onnx import OnnxExecutor

        model = str(artifact / manifest["entry_points"]["step"]["file"])
        executor = OnnxExecutor(model, max_batch, context, providers=manifest["providers"], threads=threads)
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

    def generate(self, prompts: list[Prompt], max_tokens: int = 256, chat: bool = True) -> list[GenerationResult]:
        """Greedy completions of `prompts`, in order."""
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise GenerationError(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
        started = time.perf_counter()
        sequences = []
        for index, prompt in enumerate(prompts):
            ids = self.prompt_token_ids(prompt, chat)
            if not ids:
                raise GenerationError(f"prompts[{index}] is empty after tokenization")
            if len(ids) >= self.executor.max_context:
                raise GenerationError(
                    f"prompts[{index}] has {len(ids)} tokens; the context holds {self.executor.max_context}"
                )
            sequences.append(_Sequence(slot=-1, prompt=ids, max_tokens=max_tokens))
        wave = self.executor.max_batch
        for start in range(0, len(sequences), wave):
            self._run_wave(sequences[start : start + wave])
        return [self._result(seq, started) for seq in sequences]

    def _run_wave(self, wave: list[_Sequence]) -> None:
        for slot, seq in enumerate(wave):
            seq.slot = slot
        logits = self.executor.step(StepBatch([s.slot for s in wave], [s.prompt for s in wave], [0] * len(wave)))
        running = self._accept(wave, logits)
        while running:
            batch = StepBatch(
                slots=[s.slot for s in running],
                tokens=[[s.output[-1]] for s in running],
                past_lens=[len(s.prompt) + len(s.output) - 1 for s in running],
            )
            running = self._accept(running, self.executor.step(batch))

    def _accept(self, sequences: list[_Sequence], logits: np.ndarray) -> list[_Sequence]:
        """Append each sequence's greedy token; returns those that go on."""
        now = time.perf_counter()
        still_running = []
        for seq, token in zip(sequences, logits.argmax(axis=-1).tolist(), strict=True):
            seq.output.append(token)
            seq.first_token_at = seq.first_token_at or now
            seq.last_token_at = now
            if token in self.eos_token_ids:
                seq.finish_reason = "stop"
            elif len(seq.output) >= seq.max_tokens or len(seq.prompt) + len(seq.output) >= self.executor.max_context:
                seq.finish_reason = "length"
            else:
                still_running.append(seq)
        return still_running

    def _result(self, seq: _Sequence, started: float) -> GenerationResult:
        decode_time = seq.last_token_at - seq.first_token_at
        timing = Timing(
            ttft_s=seq.first_token_at - started,
            decode_tokens_per_s=(len(seq.output) - 1) / decode_time if decode_time > 0 else 0.0,
            total_s=seq.last_token_at - started,
        )
        text = self.tokenizer.decode(seq.output, skip_special_tokens=True)
        return GenerationResult(text, seq.output, seq.prompt, seq.finish_reason or "length", timing)
