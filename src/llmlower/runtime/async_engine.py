"""AsyncEngine: the Engine behind an asyncio API, for web servers.

One background thread owns the engine and drives `step()` while any request is unfinished, so every caller's
request joins the same continuous batch. Callers add requests at any time and read their deltas from their own
queues. A caller that is cancelled (a client that disconnects, `asyncio.wait_for` timing out) or stops
iterating has its requests aborted: the abort reaches the engine thread before its next step, which frees the
requests' KV blocks. A request the engine fails (its model step, or choosing its tokens) raises RequestFailed
to its caller alone; if the engine thread itself dies, every caller, and every later one, gets RequestFailed and
`alive` turns False (a server then reports itself unhealthy and exits).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from ..errors import GenerationError, RequestFailed
from .engine import Engine
from .engine_core import EngineStats
from .intake import params_per_prompt
from .lora import LoraAdapter
from .outputs import GenerationDelta, GenerationResult
from .request import Prompt
from .sampling_params import SamplingParams
from .structured import StructuredOutput

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class _Listener:
    """Where a request's deltas go: an asyncio queue on the caller's event loop."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    position: int
    added: asyncio.Future | None = None  # settled when the engine thread has taken the request, or has died


GRAMMAR_SECONDS = 10.0  # the longest a request's structured output may take to compile


class AsyncEngine:
    def __init__(self, engine: Engine, grammar_seconds: float = GRAMMAR_SECONDS) -> None:
        """`grammar_seconds`: how long a request's grammar may compile (in a worker thread) before it is refused."""
        self.engine = engine
        self.grammar_seconds = grammar_seconds
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._listeners: dict[str, _Listener] = {}
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._stats = engine.stats()
        self.failure: BaseException | None = None  # what stopped the engine thread, if anything did

    @property
    def alive(self) -> bool:
        """False once the engine thread has died: nothing more will be served."""
        return self.failure is None

    def stats(self) -> EngineStats:
        """The engine's counters as of its last step (read without stopping it)."""
        return self._stats

    async def generate(
        self,
        prompts: Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        chat: bool = True,
    ) -> list[GenerationResult]:
        """Engine.generate without blocking the event loop; cancelling it aborts its requests."""
        results = [delta.result async for delta in self.stream(prompts, params, chat) if delta.result is not None]
        return sorted(results, key=lambda r: (r.request, r.index))

    async def stream(
        self,
        prompts: Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        chat: bool = True,
    ) -> AsyncIterator[GenerationDelta]:
        """The deltas of every completion as they are produced (`request` is the prompt's position)."""
        requests = await self.submit(prompts, params, chat)
        try:
            async for delta in requests:
                yield delta
        finally:
            requests.close()

    async def submit(
        self,
        prompts: Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        chat: bool = True,
    ) -> RequestStream:
        """Add the requests now (a bad one raises here, and none of them runs); iterate the result for their
        deltas, close it to abort what is left (a server can answer an error before it starts a response)."""
        params = params_per_prompt(prompts, params)
        outputs = {p.structured_output.llguidance_grammar: p.structured_output for p in params if p.structured_output}
        for output in outputs.values():
            await self._compiled(output)
        requests = RequestStream(self, sum(p.n for p in params))
        try:
            for position, (prompt, request_params) in enumerate(zip(prompts, params, strict=True)):
                requests.ids.append(f"async-{next(self._ids)}")
                listener = _Listener(asyncio.get_running_loop(), requests.deltas, position)
                await self._add(requests.ids[-1], prompt, request_params, chat, listener)
        except BaseException:
            requests.close()
            raise
        return requests

    async def _compiled(self, output: StructuredOutput) -> None:
        """Compile a grammar in a worker thread, neither on the event loop nor on the engine thread (which then
        finds it compiled); one that takes longer than grammar_seconds is refused (it finishes in the background,
        and a later request for it finds it compiled)."""
        try:
            await asyncio.wait_for(asyncio.to_thread(self.engine.compile_grammar, output), self.grammar_seconds)
        except TimeoutError:
            limit = f"{self.grammar_seconds:g} s"
            field = f"structured_output.{output.kind}"
            raise GenerationError(f"{field}: took longer than {limit} to compile", field) from None

    async def load_lora(self, name: str, path: str) -> None:
        """Read a PEFT adapter in a worker thread, then load it on the engine thread between two steps."""
        adapter = await asyncio.to_thread(LoraAdapter.read, path)
        await self._call(lambda: self.engine.adapters.load(name, adapter))

    async def unload_lora(self, name: str) -> bool:
        """Unload an adapter on the engine thread (False: none of that name); requests using it finish with it."""
        return await self._call(lambda: self.engine.adapters.unload(name))

    async def _call(self, command: Callable[[], T]) -> T:
        """Run `command` on the engine thread before its next step; its result, or its exception raised here."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def run() -> None:
            try:
                result = command()
            except Exception as exc:
                loop.call_soon_threadsafe(_settle, done, exc)
                return
            loop.call_soon_threadsafe(_settle, done, None, result)

        self._send(run)
        return await done

    async def close(self) -> None:
        """Stop the engine thread once it has finished its current step (unfinished requests are aborted)."""
        self._closed = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)

    # ---------------------------------------------------------------- the engine thread

    async def _add(self, request_id: str, prompt: Prompt, params: SamplingParams, chat: bool, to: _Listener) -> None:
        """Add a request on the engine thread; raises the engine's error for a bad request."""
        added = to.added = to.loop.create_future()

        def add() -> None:
            try:
                self.engine.add_request(prompt, params, chat, request_id)
            except Exception as exc:
                self._listeners.pop(request_id, None)
                to.loop.call_soon_threadsafe(_settle, added, exc)
                return
            to.loop.call_soon_threadsafe(_settle, added, None)

        self._listeners[request_id] = to  # listening already: a thread that dies before `add` runs still tells it
        try:
            self._send(add)
        except BaseException:
            self._listeners.pop(request_id, None)
            raise
        await added

    def _send(self, command: Callable[[], None]) -> None:
        """Run `command` on the engine thread before its next step (starting the thread on first use)."""
        if self.failure is not None:
            raise RequestFailed("the engine has stopped (the details are in its log)")
        if self._closed:
            raise GenerationError("this AsyncEngine is closed")
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="llmlower-engine", daemon=True)
            self._thread.start()
        self._commands.put(command)
        self._wake.set()

    def _abort(self, request_id: str) -> None:
        self._listeners.pop(request_id, None)
        self.engine.abort(request_id)

    def _run(self) -> None:
        """The engine thread; if it dies (the engine's own bookkeeping broke), every caller hears so."""
        try:
            self._serve()
        except BaseException as exc:
            self.failure = exc
            logger.critical("the engine thread stopped", exc_info=exc)
            self._fail_all(RequestFailed("the engine stopped (the details are in its log)"))

    def _serve(self) -> None:
        """Commands, then a step, while there is work; asleep otherwise."""
        while not self._closed:
            while not self._commands.empty():
                self._commands.get()()
            self._stats = self.engine.stats()
            if not self.engine.has_unfinished():
                self._wake.wait()
                self._wake.clear()
                continue
            deltas = self.engine.step()  # a request it fails comes back as its error delta
            self._stats = self.engine.stats()
            self._deliver(deltas)
            for request_id in {d.request_id for d in deltas if d.finish_reason is not None}:
                if request_id not in self.engine.requests:  # every completion of it has finished
                    self._listeners.pop(request_id, None)
        for request_id in list(self._listeners):
            self._abort(request_id)

    def _deliver(self, deltas: list[GenerationDelta]) -> None:
        """Hand a step's deltas to their listeners: one wake-up per event loop, not one per delta (each wake-up
        takes the GIL from this thread at the start of its next step)."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, GenerationDelta]]] = {}
        for delta in deltas:
            listener = self._listeners.get(delta.request_id)
            if listener is not None:
                if delta.result is not None:
                    delta.result.request = listener.position
                batch = batches.setdefault(listener.loop, [])
                batch.append((listener.queue, replace(delta, request=listener.position)))
        for loop, batch in batches.items():
            loop.call_soon_threadsafe(_put_all, batch)

    def _fail_all(self, exc: Exception) -> None:
        """Every listener gets `exc`, waiting for its request to be taken or for its deltas (the engine is not
        touched: it may be what broke)."""
        for listener in list(self._listeners.values()):
            listener.loop.call_soon_threadsafe(_settle, listener.added, exc)
            listener.loop.call_soon_threadsafe(listener.queue.put_nowait, exc)
        self._listeners.clear()


class RequestStream:
    """The deltas of requests submitted to an AsyncEngine, in the order they come; `close()` aborts the
    requests still running (call it when the caller stops listening, e.g. on cancellation)."""

    def __init__(self, engine: AsyncEngine, completions: int) -> None:
        self.engine, self.remaining = engine, completions
        self.ids: list[str] = []
        self.deltas: asyncio.Queue = asyncio.Queue()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> GenerationDelta:
        if not self.remaining:
            raise StopAsyncIteration
        item = await self.deltas.get()
        if isinstance(item, BaseException):
            raise item
        if item.error is not None:
            raise RequestFailed(item.error)
        self.remaining -= item.finish_reason is not None
        return item

    def expire(self, error: Exception) -> None:
        """Abort the requests and end the iteration with `error` (a deadline passed)."""
        self.close()
        self.deltas.put_nowait(error)

    def close(self) -> None:
        if not self.engine._closed and self.engine.alive:
            for request_id in self.ids:
                self.engine._send(lambda request_id=request_id: self.engine._abort(request_id))
        self.ids = []


def _put_all(batch: list[tuple[asyncio.Queue, GenerationDelta]]) -> None:
    for target, delta in batch:
        target.put_nowait(delta)


def _settle(future: asyncio.Future, error: Exception | None, result: Any = None) -> None:
    if not future.done():
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)
