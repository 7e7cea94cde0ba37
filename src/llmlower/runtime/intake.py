"""Request intake: a prompt and its sampling parameters checked against what the engine can serve, tokenized,
and made into a request whose sequences are ready to schedule. Everything that can be refused is refused here,
before a step: a bad request found mid-step would fail the whole batch."""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import GenerationError
from ..spec import ModelSpec
from .block_manager import BlockManager
from .detokenizer import TextStream
from .executor import Executor
from .lora import LoraAdapters
from .outputs import GenerationDelta
from .request import Prompt, Request, RequestSequence
from .sampler import SequenceSampling
from .sampling_params import SamplingParams
from .structured import GrammarCompiler, StructuredOutput
from .tokenizer import Tokenizer


class RequestIntake:
    """Validates and tokenizes requests for one engine, and builds their sequences (ids, text streams, grammars)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        spec: ModelSpec,
        executor: Executor,
        blocks: BlockManager,
        max_num_seqs: int,
        adapters: LoraAdapters,
    ) -> None:
        self.tokenizer = tokenizer
        self.adapters = adapters
        self.spec = spec
        self.executor = executor
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.eos_token_ids = frozenset(spec.eos_token_ids)
        self._sequence_ids = itertools.count()
        self._request_ids = itertools.count()
        self._grammars: GrammarCompiler | None = None  # built for the first request with structured output
        self._grammars_built = threading.Lock()

    def prompt_token_ids(
        self, prompt: Prompt, chat: bool = True, template_kwargs: Mapping[str, Any] | None = None
    ) -> list[int]:
        """Token ids of a prompt: a string through the chat template (unless chat=False), or a conversation;
        `template_kwargs`: variables for the template (tools, enable_thinking, ...)."""
        if isinstance(prompt, list):
            text = self.tokenizer.apply_chat_template(prompt, **(template_kwargs or {}))
            return self.tokenizer.encode(text, add_special_tokens=False)
        if chat:
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
            return self.tokenizer.encode(text, add_special_tokens=False)
        return self.tokenizer.encode(prompt, add_special_tokens=True)

    def checked_prompt(self, prompt: Prompt | list[int], chat: bool, label: str, params: SamplingParams) -> list[int]:
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
        if params.n > self.max_num_seqs:
            raise GenerationError(f"n={params.n} exceeds max_num_seqs={self.max_num_seqs}", "n")
        if self.blocks.num_slots and params.n > self.blocks.num_slots:
            raise GenerationError(f"n={params.n} exceeds the {self.blocks.num_slots} sequences the KV pool holds", "n")
        if self.blocks.blocks_needed(len(ids) + 1) > self.executor.num_blocks:
            blocks = self.executor.num_blocks
            raise GenerationError(f"{label} has {len(ids)} tokens; the KV pool holds {blocks} blocks", label)
        if params.structured_output is not None:
            self.grammar_compiler().check(params.structured_output)
        return ids

    def grammar_compiler(self) -> GrammarCompiler:
        """The compiler of structured outputs for this model's tokenizer, built on first use (needs llguidance)."""
        with self._grammars_built:
            if self._grammars is None:
                self._grammars = GrammarCompiler(self.tokenizer.to_json(), self.spec.vocab_size, self.eos_token_ids)
        return self._grammars

    def compile_grammar(self, output: StructuredOutput) -> None:
        """Compile a structured output now, from any thread (a server's worker), so that adding a request that asks
        for it finds it compiled; a bad one raises here."""
        self.grammar_compiler().check(output)

    def request(
        self,
        ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        outbox: deque[GenerationDelta] | None = None,
    ) -> Request:
        """A request of checked prompt ids with its n sequences (the first to schedule, the others its forks);
        `outbox` keeps the deltas of a generate/stream call."""
        request_id = request_id or f"req-{next(self._request_ids)}"
        request = Request(request_id, list(ids), params, time.perf_counter(), outbox=outbox)
        output = params.structured_output
        constraints = [None] * params.n if output is None else self.grammar_compiler().constraints(output, params.n)
        for index, constraint in enumerate(constraints):
            sequence = RequestSequence(
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
        request.lora_slot, salt = self.adapters.acquire(params.lora)  # last: nothing after it can fail
        for sequence in request.sequences:
            sequence.cache_salt = salt
        return request

    def _text_stream(self, params: SamplingParams) -> TextStream:
        """A sequence's detokenizer with the request's stops (its stop strings and tokens, and EOS unless ignored)."""
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids))
        return TextStream(
            self.tokenizer,
            stop=params.stop,
            stop_token_ids=stop_ids,
            max_tokens=params.max_tokens,
            include_stop_str_in_output=params.include_stop_str_in_output,
            skip_special_tokens=params.skip_special_tokens,
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
