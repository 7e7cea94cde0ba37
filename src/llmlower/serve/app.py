"""The OpenAI-compatible FastAPI app around an AsyncEngine: /v1/models, /v1/completions, /v1/chat/completions
(whole or as server-sent events, with tool calls), /v1/embeddings (an embedding model's), /tokenize and
/detokenize, /health and /metrics.

Every request is checked before the engine sees it (API key, body size, the model's name, field types, sampling
values, the context), and refused in OpenAI's error envelope. The engine's one thread serves all requests in one
continuous batch; a client that disconnects (streaming or not) has its request aborted, which frees its KV blocks
before the next step. While the server drains (SIGTERM), new requests get 503 and running ones finish.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTasks
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..errors import ArgumentError, GenerationError, RequestFailed
from ..runtime import AsyncEngine, GenerationResult, SamplingParams
from ..runtime.async_engine import RequestStream
from . import errors
from .engine_params import (
    COMPLETIONS_MAX_TOKENS,
    completion_prompts,
    grammar_source,
    sampling_params,
    structured_error,
    top_logprobs,
)
from .errors import APIError
from .limits import LimitExceeded, RequestLimits
from .metrics import Metrics
from .responses import Formatter, embedding_response, sse, usage
from .schemas import (
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    LoadLoraRequest,
    TokenizeRequest,
    UnloadLoraRequest,
)
from .tools import ChatPrompt, chat_prompt


@dataclass(frozen=True)
class ServerConfig:
    """`max_waiting`: sequences that may wait beyond the engine's max_num_seqs before new requests get 429;
    `max_body_bytes`: larger request bodies get 413; `limits`: what one request may ask for (400 beyond);
    `request_timeout`: seconds a request may run before it is aborted (408), None for no limit; `lora_loading`:
    clients with the key may load adapters from this machine's paths and unload them."""

    model_name: str
    api_key: str | None = None
    max_waiting: int = 256
    max_body_bytes: int = 4 << 20
    limits: RequestLimits = RequestLimits()
    request_timeout: float | None = 600.0
    lora_loading: bool = False  # /v1/load_lora_adapter and /v1/unload_lora_adapter are served


NO_DEADLINE = 1e9  # seconds: no --request-timeout, as a deadline that never comes


class RequestTimedOut(GenerationError):
    """A request ran past the server's --request-timeout."""


class BodyLimit:
    """ASGI middleware: a request body over the limit is answered 413 before the app reads it (by its
    Content-Length, or as it arrives when it is chunked)."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            await self._refuse(scope, receive, send)
            return
        received = 0

        async def counting() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.limit:
                raise APIError(413, f"the request body is over {self.limit} bytes", None, "request_too_large")
            return message

        await self.app(scope, counting, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        error = APIError(413, f"the request body is over {self.limit} bytes", None, "request_too_large")
        await error.response()(scope, receive, send)


class Admission:
    """Sequences in hand (running or waiting in the engine): a request that would take them over `capacity`
    is refused with 429."""

    def __init__(self, capacity: int) -> None:
        self.capacity, self.held = capacity, 0

    def take(self, count: int) -> Callable[[], None]:
        """Hold `count` sequences; returns the function that lets them go (once, however often it is called)."""
        if self.held + count > self.capacity:
            raise APIError(429, "the waiting queue is full; retry later", None, "queue_full", retry_after=1)
        self.held += count
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.held -= count

        return release


def _param(error: GenerationError, field: str) -> str:
    """The request field an engine error names where it is one of the request's own (n, logit_bias,
    stop_token_ids), else `field` (the prompt's or messages' name in this request)."""
    return error.field if error.field in ("n", "logit_bias", "stop_token_ids") else field


def build_app(engine: AsyncEngine, config: ServerConfig) -> FastAPI:
    """The app serving `engine` under the name config.model_name."""
    app = FastAPI(title="llmlower", docs_url=None, redoc_url=None)
    errors.install(app)
    app.add_middleware(BodyLimit, limit=config.max_body_bytes)
    metrics = Metrics(engine.stats, config.model_name)
    tokenizer = engine.engine.tokenizer
    max_context = engine.engine.executor.max_context
    app.state.draining = False
    admission = Admission(engine.engine.config.max_num_seqs + config.max_waiting)

    async def admitted(request: Request) -> None:
        """The API key, and not shutting down."""
        if config.api_key is not None:
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {config.api_key}".encode()):
                raise APIError(401, "a valid API key is needed (Authorization: Bearer KEY)", None, "invalid_api_key")
        if app.state.draining:
            raise APIError(503, "the server is shutting down", None, "shutting_down", retry_after=5)

    @app.get("/health")
    async def health() -> Response:
        if not engine.alive:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        if app.state.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models", dependencies=[Depends(admitted)])
    async def models() -> dict[str, Any]:
        card = {"object": "model", "created": int(time.time()), "owned_by": "llmlower", "max_model_len": max_context}
        base = {**card, "id": config.model_name, "root": config.model_name, "parent": None}
        adapters = [{**card, "id": name, "root": name, "parent": config.model_name} for name in engine.engine.loras]
        return {"object": "list", "data": [base, *adapters]}

    def named(model: str | None) -> str | None:
        """The LoRA adapter a request's model names (None: the base model); 404 for any other name."""
        if model is None or model == config.model_name:
            return None
        if model in engine.engine.loras:
            return model
        raise APIError(404, f"the model `{model}` does not exist", "model", "model_not_found")

    if config.lora_loading:

        @app.post("/v1/load_lora_adapter", dependencies=[Depends(admitted)])
        async def load_lora_adapter(body: LoadLoraRequest) -> dict[str, Any]:
            """Load a PEFT adapter directory of this machine into a free slot under lora_name."""
            if body.lora_name == config.model_name:
                raise APIError(400, "lora_name: the base model's name", "lora_name", "invalid_value")
            try:
                await engine.load_lora(body.lora_name, body.lora_path)
            except ArgumentError as error:
                param = "lora_path" if body.lora_path in str(error) else "lora_name"
                raise APIError(400, str(error), param, "invalid_value") from None
            return {"object": "lora_adapter", "id": body.lora_name, "status": "loaded"}

        @app.post("/v1/unload_lora_adapter", dependencies=[Depends(admitted)])
        async def unload_lora_adapter(body: UnloadLoraRequest) -> dict[str, Any]:
            """Unload an adapter; requests using it finish with it."""
            if not await engine.unload_lora(body.lora_name):
                message = f"the LoRA adapter `{body.lora_name}` is not loaded"
                raise APIError(404, message, "lora_name", "model_not_found")
            return {"object": "lora_adapter", "id": body.lora_name, "status": "unloaded"}

    @app.post("/tokenize", dependencies=[Depends(admitted)])
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        """A prompt's or a chat's token ids, as the completions or chat endpoint would give them to the model."""
        named(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", "prompt", "invalid_value")
        try:
            if body.messages is not None:
                chat = ChatRequest(
                    model=config.model_name,
                    messages=body.messages,
                    tools=body.tools,
                    chat_template_kwargs=body.chat_template_kwargs,
                )
                prompt = chat_prompt(chat, tokenizer)
                rendered = engine.engine.prompt_token_ids  # as the chat endpoint renders it, off the event loop
                ids = await asyncio.to_thread(rendered, prompt.messages, True, prompt.template_kwargs)
            else:
                ids = await asyncio.to_thread(tokenizer.encode, body.prompt, body.add_special_tokens)
        except GenerationError as error:
            raise APIError(400, str(error), "messages", "invalid_value") from None
        reply: dict[str, Any] = {"count": len(ids), "max_model_len": max_context, "tokens": ids}
        if body.return_token_strs:
            reply["token_strs"] = [tokenizer.decode([token], skip_special_tokens=False) for token in ids]
        return reply

    @app.post("/detokenize", dependencies=[Depends(admitted)])
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        """Token ids' text (special tokens kept)."""
        named(body.model)
        bad = next((t for t in body.tokens if not 0 <= t < tokenizer.vocab_size), None)
        if bad is not None:
            message = f"tokens: {bad} is not a token id (the vocabulary has {tokenizer.vocab_size})"
            raise APIError(400, message, "tokens", "invalid_value")
        return {"prompt": await asyncio.to_thread(tokenizer.decode, body.tokens, False)}

    def check(body: CompletionRequest | ChatRequest) -> None:
        """The model's name and the server's limits, before anything is tokenized."""
        named(body.model)
        if engine.engine.pooling is not None:
            message = f"the model `{body.model}` embeds text (compiled with --task embed): use /v1/embeddings"
            raise APIError(400, message, "model", "invalid_value")
        try:
            config.limits.check(body, top_logprobs(body), grammar_source(body))
        except LimitExceeded as error:
            raise APIError(400, str(error), error.param, "too_large") from None

    @app.post("/v1/completions", dependencies=[Depends(admitted)])
    async def completions(body: CompletionRequest, request: Request) -> Response:
        check(body)
        prompts = completion_prompts(body.prompt)

        async def tokenized() -> list[list[int]]:
            return [p if isinstance(p, list) else await asyncio.to_thread(tokenizer.encode, p) for p in prompts]

        return await admitted_request(body, request, len(prompts), tokenized, chat=None)

    @app.post("/v1/chat/completions", dependencies=[Depends(admitted)])
    async def chat_completions(body: ChatRequest, request: Request) -> Response:
        check(body)
        prompt = chat_prompt(body, tokenizer)

        async def tokenized() -> list[list[int]]:
            try:
                ids = engine.engine.prompt_token_ids
                return [await asyncio.to_thread(ids, prompt.messages, True, prompt.template_kwargs)]
            except GenerationError as error:
                raise APIError(400, str(error), "messages", "invalid_value") from None

        return await admitted_request(body, request, 1, tokenized, chat=prompt)

    @app.post("/v1/embeddings", dependencies=[Depends(admitted)])
    async def embeddings(body: EmbeddingRequest, request: Request) -> Response:
        """An embedding model's vectors of the inputs, batched with every other request."""
        adapter = named(body.model)
        if engine.engine.pooling is None:
            message = f"the model `{body.model}` generates text: embeddings need a model compiled with --task embed"
            raise APIError(400, message, "model", "invalid_value")
        inputs = completion_prompts(body.input, "input")
        try:
            config.limits.check_inputs(len(inputs))
        except LimitExceeded as error:
            raise APIError(400, str(error), error.param, "too_large") from None
        width = engine.engine.spec.hidden_size
        if body.dimensions is not None and body.dimensions > width:
            message = f"dimensions: at most the model's {width}, got {body.dimensions}"
            raise APIError(400, message, "dimensions", "invalid_value")
        release = admission.take(len(inputs))
        try:
            ids = [p if isinstance(p, list) else await asyncio.to_thread(tokenizer.encode, p) for p in inputs]
            longest = max(len(p) for p in ids)
            if longest >= max_context:
                message = f"input: {longest} tokens exceed the context of {max_context - 1} tokens"
                raise APIError(400, message, "input", "context_length_exceeded")
            try:
                stream = await engine.submit(ids, SamplingParams(max_tokens=1, lora=adapter), chat=False)
            except RequestFailed as error:
                raise stream_error(error) from None
            except GenerationError as error:
                raise APIError(400, str(error), "input", "invalid_value") from None
            timer = deadline(stream, release)
            try:
                results = await collect_or_abort(stream, request)
            except GenerationError as error:
                raise stream_error(error) from None
            finally:
                timer.cancel()
        finally:
            release()
        model = adapter or config.model_name
        return JSONResponse(embedding_response(results, model, body.encoding_format, body.dimensions))

    async def admitted_request(
        body: ChatRequest | CompletionRequest,
        request: Request,
        prompts: int,
        tokenized: Callable[[], Awaitable[list[list[int]]]],
        chat: ChatPrompt | None,
    ) -> Response:
        """Hold the request's sequences (429 when the queue is full) before its prompts are tokenized; they are let
        go when it is answered, or at once if anything fails before its answer starts."""
        release = admission.take(prompts * max(body.n, 1))
        try:
            return await respond(body, request, await tokenized(), chat, release)
        except BaseException:
            release()
            raise

    async def respond(
        body: ChatRequest | CompletionRequest,
        request: Request,
        ids: list[list[int]],
        chat: ChatPrompt | None,
        release: Callable[[], None],
    ) -> Response:
        """Check the prompts against the context, submit them, and answer whole or as a stream (`chat`: a chat's
        prompt, None for completions)."""
        field = "messages" if chat else "prompt"
        longest = max(len(p) for p in ids)
        params = await checked_params(body, max(1, max_context - longest) if chat else COMPLETIONS_MAX_TOKENS, chat)
        adapter = named(body.model)
        params = replace(params, lora=adapter)
        asked = (body.max_completion_tokens or body.max_tokens) if chat else body.max_tokens
        if longest + (asked or 1) > max_context:  # without max_tokens, generation stops at the context
            what = f"{longest} prompt tokens" + (f" + max_tokens {asked}" if asked else "")
            message = f"{field}: {what} exceed the context of {max_context} tokens"
            raise APIError(400, message, field, "context_length_exceeded")
        try:
            stream = await engine.submit(ids, params, chat=False)
        except RequestFailed as error:  # the engine, not the request
            raise stream_error(error) from None
        except GenerationError as error:
            message = str(error)
            refusal = structured_error(error, body) or APIError(400, message, _param(error, field), "invalid_value")
            raise refusal from None
        formatter = Formatter(tokenizer, adapter or config.model_name, params.n, chat)
        timer = deadline(stream, release)
        if body.stream:
            with_usage = bool(body.stream_options and body.stream_options.include_usage)
            events = stream_events(stream, formatter, len(ids), with_usage, release)
            # also when the client leaves before the first event (the events then never start)
            background = BackgroundTasks()
            for task in (stream.close, release, timer.cancel):
                background.add_task(task)
            return StreamingResponse(events, media_type="text/event-stream", background=background)
        try:
            return JSONResponse(formatter.response(await collect_or_abort(stream, request)))
        except GenerationError as error:
            raise stream_error(error) from None
        finally:
            timer.cancel()
            release()

    async def checked_params(
        body: ChatRequest | CompletionRequest, max_tokens: int, chat: ChatPrompt | None
    ) -> SamplingParams:
        """The request's SamplingParams, built in a worker thread: a structured output (or a tool grammar) is
        translated and checked by llguidance there, not on the event loop, within the engine's grammar time limit."""
        try:
            built = asyncio.to_thread(sampling_params, body, max_tokens, chat)
            return await asyncio.wait_for(built, engine.grammar_seconds)
        except TimeoutError:
            field = "tools" if chat and chat.grammar else (grammar_source(body) or ("structured_outputs", None))[0]
            message = f"{field}: took longer than {engine.grammar_seconds:g} s to check"
            raise APIError(400, message, field, "invalid_value") from None

    def deadline(stream: RequestStream, release: Callable[[], None]) -> asyncio.TimerHandle:
        """The request's deadline: after request_timeout its stream expires (its sequences aborted, its iteration
        ending in RequestTimedOut) and its admission is let go, whether its client still reads or not."""
        seconds = config.request_timeout or NO_DEADLINE
        error = RequestTimedOut(f"the request ran longer than this server's --request-timeout of {seconds:g} s")

        def expire() -> None:
            stream.expire(error)
            release()

        return asyncio.get_running_loop().call_later(seconds, expire)

    async def collect_or_abort(stream: RequestStream, request: Request) -> list[GenerationResult]:
        """Every completion's result; the requests are aborted if the client goes away first."""
        collector = asyncio.ensure_future(finished(stream))
        watcher = asyncio.ensure_future(disconnected(request))
        try:
            done, _ = await asyncio.wait({collector, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if collector not in done:
                raise APIError(499, "the client closed the request")
            return collector.result()
        finally:
            for task in (collector, watcher):
                task.cancel()
            stream.close()

    async def finished(stream: RequestStream) -> list[GenerationResult]:
        results = []
        async for delta in stream:
            if delta.result is not None:
                metrics.observe(delta.result)
                results.append(delta.result)
        return results

    async def stream_events(
        stream: RequestStream, formatter: Formatter, count: int, with_usage: bool, release: Callable[[], None]
    ) -> AsyncIterator[str]:
        """The stream as server-sent events: a chunk per delta, then usage if asked, then [DONE]."""
        results: list[GenerationResult] = []
        offsets: dict[int, int] = {}  # choice -> characters sent (completions' text_offset)
        try:
            if formatter.chat:
                choices = [formatter.role_choice(i) for i in range(count * formatter.n)]
                yield sse(formatter.chunk(choices, None, with_usage))
            async for delta in stream:
                index = formatter.index(delta.request, delta.index)
                choice = formatter.delta_choice(delta, offsets.get(index, 0))
                offsets[index] = offsets.get(index, 0) + len(delta.text)
                yield sse(formatter.chunk([choice], None, with_usage))
                if delta.result is not None:
                    metrics.observe(delta.result)
                    results.append(delta.result)
            if with_usage:
                yield sse(formatter.chunk([], usage(results), True))
            yield "data: [DONE]\n\n"
        except GenerationError as error:  # the request failed or expired mid-stream: the client hears so, then [DONE]
            yield stream_error(error).event()
            yield "data: [DONE]\n\n"
        finally:
            stream.close()
            release()

    return app


def stream_error(error: GenerationError) -> APIError:
    """How a request that failed after it was accepted is answered: 408 past its deadline, else 500 saying what
    the engine was doing (never its internals)."""
    if isinstance(error, RequestTimedOut):
        return APIError(408, str(error), None, "request_timeout")
    return APIError(500, str(error), None, "engine_error")


async def disconnected(request: Request) -> None:
    """Returns when the client closes its connection (the request's body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
