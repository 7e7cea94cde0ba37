"""`llmlower serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) with Prometheus metrics around the
runtime's AsyncEngine; needs the `serve` extra. No torch: an artifact is served with the runtime alone. The app is
imported when first asked for, so the command line reads serve.limits without FastAPI installed."""

from typing import Any

__all__ = ["ServerConfig", "build_app", "run", "serving_app"]


def __getattr__(name: str) -> Any:
    if name in ("ServerConfig", "build_app"):
        from . import app

        return getattr(app, name)
    if name in ("run", "serving_app"):
        from . import server

        return getattr(server, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
