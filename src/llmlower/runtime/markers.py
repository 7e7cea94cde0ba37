"""Text arriving in pieces that may end partway into a marker (a stop string, a tool-call tag, a thinking tag):
how much of it to hold back until the next piece says."""

from __future__ import annotations

from collections.abc import Iterable


def held_back(text: str, markers: Iterable[str]) -> int:
    """Length of the longest end of `text` that is a proper prefix of one of `markers` (it may still become one)."""
    held = 0
    for marker in markers:
        for length in range(min(len(marker) - 1, len(text)), held, -1):
            if text.endswith(marker[:length]):
                held = length
                break
    return held
