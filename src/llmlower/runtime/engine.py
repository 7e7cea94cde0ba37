"""Engine: turns prompts into completions; the facade that loads an artifact and wires request intake
(runtime/intake.py), the engine core's step loop (runtime/engine_core.py) and output processing
(runtime/output_processor.py).

Requests arrive at any time (`add_request`); each `step()` runs one step of the batch and returns the deltas of
those requests. `generate` and `stream` are built on these calls, so several of them (interleaved generators, or
callers of add_request) share the engine's batch. One thread drives an engine at a time (AsyncEngine runs it in a
thread of its own for asyncio servers).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import GenerationError, RequestFailed
from ..spec import ModelSpec
from ..step_io import DEFAULT_BLOCK_SIZE
from .artifact import draft_artifact, embedding_pooling, kv_cache_dtype, read_manifest
from .block_manager import BlockManager, kv_pool_blocks
from .engine_core import EngineCore, EngineStats
from .executor import Executor
from .executors import load_executor
from .intake import RequestIntake, params_per_prompt
from .lora import LoraAdapter, LoraAdapters
from .output_processor import OutputProcessor
from .outputs import GenerationDelta, GenerationResult
from .proposers import make_proposer
from .request import Prompt
from .sampler import Sampler
from .sampling_params import SamplingParams
from .scheduler import Scheduler
from .speculative import SpeculativeConfig
from .structured import StructuredOutput
from .tokenizer import Tokenizer
from .weights import WeightSource

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineConfig:
    """Serving limits: sequences per step, tokens per step (prompt chunks and decodes together), the longest
    sequence, and the KV pool (`num_blocks` or `kv_cache_memory` bytes; default: every sequence can reach
    max_context). `block_size` of a paged artifact is fixed when compiling."""

    max_num_seqs: int = 16
    max_num_batched_tokens: int = 128  # CPU: a step's prompt chunk stays short (docs/benchmarks.md)
    max_context: int | None = 2048
    block_size: int | None = None
    num_blocks: int | None = None
    kv_cache_memory: int | None = None
    enable_prefix_caching: bool = True
    speculative: SpeculativeConfig | None = None  # speculative decoding: the proposer and its tokens per step


class Engine:
    """The engine's public face: load an artifact, add requests and step them, or generate and stream."""

    def __init__(
        self,
        executor: Executor,
        tokenizer: Tokenizer,
        spec: ModelSpec,
        seed: int | None = None,
        config: EngineConfig | None = None,
        draft: Executor | None = None,
        pooling: str | None = None,
    ) -> None:
        """`draft`: the draft model's executor when config.speculative uses one (a pool of the target's shape);
        `pooling`: an embedding model's (last or mean, its embed pass's): each request's result is its prompt's
        embedding."""
        config = config or EngineConfig()
        if pooling is not None and config.speculative is not None:
            raise GenerationError("an embedding model generates no tokens: it takes no speculative decoding")
        self.pooling = pooling
        self.executor = executor
        self.tokenizer = tokenizer
        self.spec = spec
        self.config = config
        self.sampler = Sampler(frozenset(spec.eos_token_ids), np.random.default_rng(seed))
        if draft is not None and draft.states:
            raise GenerationError(
                "speculative decoding: the draft model keeps a recurrent state (a hybrid model), which cannot yet be "
                "rolled back past rejected guesses; use --speculative ngram or a draft without recurrent layers"
            )
        # A cached prefix holds KV entries but not the recurrent state after it: hybrid models compute every prompt;
        # nor the rows a mean is taken over.
        prefix_caching = config.enable_prefix_caching and not executor.states and pooling != "mean"
        if config.enable_prefix_caching and not prefix_caching:
            logger.info(
                "prefix caching is off: this model keeps a recurrent state, which a cached prefix does not hold"
            )
        self.blocks = BlockManager(
            executor.num_blocks, executor.block_size, prefix_caching, executor.blocks_per_slot, executor.num_state_slots
        )
        speculative = config.speculative
        lookahead = speculative.num_tokens if speculative else 0
        self.scheduler = Scheduler(
            self.blocks, config.max_num_seqs, config.max_num_batched_tokens, lookahead, executor.max_context
        )
        self.proposer = make_proposer(speculative, draft, executor, self.sampler, self.blocks.block_table)
        self.adapters = LoraAdapters(executor.lora)
        self.intake = RequestIntake(tokenizer, spec, executor, self.blocks, config.max_num_seqs, self.adapters)
        outputs = OutputProcessor(executor.max_context, speculating=self.proposer is not None)
        self.core = EngineCore(
            executor, draft, self.blocks, self.scheduler, self.sampler, self.proposer, outputs, pooling, self.adapters
        )
        self.requests = self.core.requests
        self._driver = threading.Lock()

    @classmethod
    def load(
        cls,
        artifact: str | Path,
        config: EngineConfig | None = None,
        threads: int = 0,
        weights: str = "auto",
        weights_seed: int = 0,
        loras: Mapping[str, str | Path | LoraAdapter] | None = None,
        **limits: int | bool | None,
    ) -> Engine:
        """An Engine on a compiled artifact (code: TVM's model.so and MLIR modules run natively in this process, so
        only artifacts you trust); needs only numpy, tokenizers, jinja2 and the backend's runtime.
        `config` or EngineConfig's fields as keywords (max_num_seqs=4, max_context=512, ...) set its limits.
        `weights`: "auto" reads the artifact's weights file; "random" makes up every weight the manifest lists
        from `weights_seed` instead (dummy weights, for speed runs where the weights file is absent).
        `loras`: PEFT adapter directories to load by name (an artifact compiled with --lora-rank)."""
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
            state_bytes=spec.state_bytes,
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
        pooling = embedding_pooling(manifest["pipeline"])
        engine = cls(executor, tokenizer, spec, config=config, draft=draft, pooling=pooling)
        for name, path in (loras or {}).items():
            engine.load_lora(name, path)
        return engine

    # ---------------------------------------------------------------- requests

    def prompt_token_ids(
        self, prompt: Prompt, chat: bool = True, template_kwargs: Mapping[str, Any] | None = None
    ) -> list[int]:
        """Token ids of a prompt: a string through the chat template (unless chat=False), or a conversation;
        `template_kwargs`: variables for the template (tools, enable_thinking, ...)."""
        return self.intake.prompt_token_ids(prompt, chat, template_kwargs)

    def compile_grammar(self, output: StructuredOutput) -> None:
        """Compile a structured output now, from any thread (a server's worker), so that adding a request that asks
        for it finds it compiled; a bad one raises here."""
        self.intake.compile_grammar(output)

    def add_request(
        self,
        prompt: Prompt | list[int],
        params: SamplingParams | None = None,
        chat: bool = True,
        request_id: str | None = None,
    ) -> str:
        """Queue a request (a prompt, a conversation, or token ids); returns its id. Its deltas come from step()."""
        params = params or SamplingParams()
        with self._driving():
            ids = self.intake.checked_prompt(prompt, chat, "prompt", params)
            request = self.intake.request(ids, params, request_id)
            self.core.add(request)
            return request.request_id

    def load_lora(self, name: str, adapter: str | Path | LoraAdapter) -> None:
        """Load a PEFT LoRA adapter (a directory with adapter_config.json and adapter_model.safetensors, or one
        read already) into a free adapter slot; requests then ask for it by name (SamplingParams.lora)."""
        if not isinstance(adapter, LoraAdapter):
            adapter = LoraAdapter.read(adapter)  # the files are read before the engine is held
        with self._driving():
            self.adapters.load(name, adapter)

    def unload_lora(self, name: str) -> bool:
        """Unload an adapter (False: none is loaded under `name`); requests using it finish with it."""
        with self._driving():
            return self.adapters.unload(name)

    @property
    def loras(self) -> list[str]:
        """The names of the loaded LoRA adapters."""
        return self.adapters.names()

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its KV blocks; False if it is unknown or already finished."""
        with self._driving():
            return self.core.abort(request_id)

    def has_unfinished(self) -> bool:
        """Some request still has a completion to run."""
        return self.core.has_unfinished()

    def step(self) -> list[GenerationDelta]:
        """Run one step of every scheduled sequence; returns the deltas of requests added with add_request
        (those of generate/stream calls go to their callers)."""
        with self._driving():
            return self.core.step()

    def stats(self) -> EngineStats:
        """Queue sizes, KV pool use, prefix cache and token counters, for a server's metrics."""
        return self.core.stats()

    # ---------------------------------------------------------------- batch calls

    def embed(self, texts: Sequence[str | list[int]]) -> list[np.ndarray]:
        """An embedding model's vectors of `texts` (strings, with the tokenizer's special tokens, or token ids):
        each one pooled and L2-normalized, float32; batched as generate batches completions."""
        if self.pooling is None:
            raise GenerationError("this model generates text: compile it with --task embed to embed")
        if isinstance(texts, str):
            raise GenerationError("texts must be a list of strings or of token id lists")
        results = self.generate(list(texts), SamplingParams(max_tokens=1), chat=False)
        return [np.asarray(result.embedding, dtype=np.float32) for result in results]

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
            encoded = [self.intake.checked_prompt(p, chat, f"prompts[{i}]", sp) for i, (p, sp) in enumerate(pairs)]
            requests = [self.intake.request(ids, sp, outbox=deque()) for ids, sp in zip(encoded, params, strict=True)]
            for request in requests:
                self.core.add(request)
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
                    self.core.abort(request.request_id)
                    self.requests.pop(request.request_id, None)

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
