"""AsyncEngine: the Engine behind an asyncio API, for web servers.

The engine runs in a worker thread so the event loop stays free; calls are served one at a time (the
engine and its KV cache are not shared between threads) and each streaming caller gets its deltas through
its own queue. A caller that stops listening (a client that disconnects) stops its generation at the next
token. Admitting new requests between decode steps comes with continuous batching.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Sequence

from .engine import Engine, GenerationDelta, GenerationResult, Prompt
from .sampling import SamplingParams

_DONE = object()


class AsyncEngine:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._turn = asyncio.Lock()

    async def generate(
        self,
        prompts: Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        chat: bool = True,
    ) -> list[GenerationResult]:
        """Engine.generate without blocking the event loop."""
        async with self._turn:
            return await asyncio.to_thread(self.engine.generate, prompts, params, chat)

    async def stream(
        self,
        prompts: Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        chat: bool = True,
    ) -> AsyncIterator[GenerationDelta]:
        """Engine.stream's deltas as they are produced."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        stop = threading.Event()

        def produce() -> None:
            try:
                for delta in self.engine.stream(prompts, params, chat):
                    loop.call_soon_threadsafe(queue.put_nowait, delta)
                    if stop.is_set():
                        break
            except Exception as exc:  # handed to the caller, raised there
                loop.call_soon_threadsafe(queue.put_nowait, exc)
            finally:
                loop.call_soon_threadsafe(queue.put_nowait, _DONE)

        async with self._turn:
            worker = loop.run_in_executor(None, produce)
            try:
                while (item := await queue.get()) is not _DONE:
                    if isinstance(item, Exception):
                        raise item
                    yield item
            finally:
                stop.set()
                await worker  # the engine is free again before the next call takes its turn
