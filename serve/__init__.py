"""`llmlower serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) with Prometheus metrics around the
runtime's AsyncEngine; needs the `serve` extra. No torch: an artifact is served with the runtime alone."""

from .app import ServerConfig, build_app
from .server import run, serving_app

__all__ = ["ServerConfig", "build_app", "run", "serving_app"]
