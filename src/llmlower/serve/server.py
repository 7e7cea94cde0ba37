"""Run the app with uvicorn. SIGTERM (or Ctrl-C) drains: the listening socket closes, requests that arrive on open
connections get 503, running ones finish within `drain_timeout` seconds, then the engine thread stops and the
process exits. If the engine thread dies, the server stops at once and `run` raises, so the process exits non-zero
(and a supervisor restarts it)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from types import FrameType

import uvicorn
from fastapi import FastAPI

from ..errors import LlmlowerError
from ..runtime import AsyncEngine, Engine
from .app import ServerConfig, build_app


class DrainingServer(uvicorn.Server):
    """uvicorn's server, telling the app when the shutdown starts so that it turns new requests away, and stopping
    when the app's engine thread has died."""

    def __init__(self, config: uvicorn.Config, app: FastAPI) -> None:
        super().__init__(config)
        self.app = app

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.app.state.draining = True
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        if not self.app.state.engine.alive:
            return True
        return await super().on_tick(counter)


def serving_app(engine: Engine, config: ServerConfig) -> FastAPI:
    """The app with the engine's thread tied to its lifetime (stopped when the app shuts down)."""
    server = AsyncEngine(engine)
    app = build_app(server, config)
    app.state.engine = server

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await server.close()

    app.router.lifespan_context = lifespan
    return app


def run(engine: Engine, config: ServerConfig, host: str = "127.0.0.1", port: int = 8000, drain_timeout: int = 30):
    """Serve until SIGTERM/SIGINT, then drain (see the module docstring)."""
    app = serving_app(engine, config)
    settings = uvicorn.Config(app, host=host, port=port, timeout_graceful_shutdown=drain_timeout, log_level="info")
    DrainingServer(settings, app).run()
    failure = app.state.engine.failure
    if failure is not None:
        raise LlmlowerError(f"the engine thread stopped ({type(failure).__name__}: {failure}); the server exited")
