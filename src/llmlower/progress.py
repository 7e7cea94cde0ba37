"""Stage reporting for long work (load, capture, passes): the library announces stages, a reporter shows them.

The default reporter is silent; the CLI installs one that draws a spinner and timings on stderr.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Protocol


class Reporter(Protocol):
    def start(self, description: str) -> None: ...
    def finish(self, description: str, seconds: float, detail: str) -> None: ...


class _Silent:
    def start(self, description: str) -> None:
        pass

    def finish(self, description: str, seconds: float, detail: str) -> None:
        pass


_reporter: Reporter = _Silent()


def use_reporter(reporter: Reporter | None) -> None:
    """Install `reporter` for all following stages (None restores the silent default)."""
    global _reporter
    _reporter = reporter or _Silent()


class StageResult:
    """Handed to the body of a stage so it can add a detail (e.g. '30 matches') to the finished line."""

    detail = ""


@contextlib.contextmanager
def stage(description: str) -> Iterator[StageResult]:
    result = StageResult()
    _reporter.start(description)
    started = time.perf_counter()
    yield result
    _reporter.finish(description, time.perf_counter() - started, result.detail)
