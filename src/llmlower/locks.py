"""Lock files beside cached entries (compiled artifacts, the example model), so that several llmlower processes
sharing a cache have one writer at a time and readers never see an entry being replaced."""

from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Callable, Iterator
from pathlib import Path


@contextlib.contextmanager
def locked(entry: Path, exclusive: bool, notify: Callable[[str], None]) -> Iterator[None]:
    """Hold the entry's lock file (shared to read, exclusive to write), saying so when another process holds it."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    with (entry.parent / f"{entry.name}.lock").open("a") as lock:  # "a": created if missing, never truncated
        mode = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
        try:
            fcntl.flock(lock, mode | fcntl.LOCK_NB)
        except BlockingIOError:
            notify(f"waiting for another llmlower process using {entry}")
            fcntl.flock(lock, mode)
        yield  # closing the file releases the lock
