"""Reasoning in a reply: the text a model writes between its template's thinking markers (`<think>`, `</think>`),
kept apart from the answer. The markers are read from the chat template's own text; a reply begins inside them
where the generation prompt opens them (templates that start every answer thinking)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from .markers import held_back

MARKER = re.compile(r"<(\w*(?:think|reason)\w*)>")


@dataclass(frozen=True)
class ReasoningFormat:
    """The markers around reasoning."""

    start: str
    end: str

    def opened_by(self, generation_prompt: str) -> bool:
        """Whether a generation prompt leaves a reasoning block open (the reply starts inside it)."""
        start = generation_prompt.rfind(self.start)
        return start >= 0 and generation_prompt.find(self.end, start) < 0


def find_reasoning(template: str | None) -> ReasoningFormat | None:
    """The reasoning markers a chat template writes (an opening tag whose closing tag it also writes), or None."""
    for match in MARKER.finditer(template or ""):
        if f"</{match.group(1)}>" in template:
            return ReasoningFormat(match.group(0), f"</{match.group(1)}>")
    return None


class ReasoningParser:
    """Splits a reply, as its text arrives, into reasoning and content: a reply that opens with the start marker
    (or that the prompt started inside it) reasons until the end marker; the rest is content."""

    def __init__(self, format: ReasoningFormat, inside: bool = False) -> None:
        self.format = format
        self._state = "reasoning" if inside else "start"  # start, reasoning, answer (its first text ahead), content
        self._buffer = ""

    def feed(self, text: str) -> tuple[str, str]:
        """Take the next text; returns the new (reasoning, content)."""
        self._buffer += text
        reasoning = ""
        if self._state == "start":
            opening = self._buffer.lstrip()
            if self.format.start.startswith(opening) and len(opening) < len(self.format.start):
                return "", ""  # the start marker may be arriving
            if opening.startswith(self.format.start):
                self._buffer, self._state = opening[len(self.format.start) :], "reasoning"
            else:
                self._state = "content"
        if self._state == "reasoning":
            end = self._buffer.find(self.format.end)
            if end < 0:
                cut = len(self._buffer) - held_back(self._buffer, [self.format.end])
                reasoning, self._buffer = self._buffer[:cut], self._buffer[cut:]
                return reasoning, ""
            reasoning, self._buffer = self._buffer[:end], self._buffer[end + len(self.format.end) :]
            self._state = "answer"
        if self._state == "answer":  # the whitespace between the end marker and the answer is neither
            self._buffer = self._buffer.lstrip()
            self._state = "content" if self._buffer else "answer"
        content, self._buffer = self._buffer, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """The reply has ended: what is still held back (a start that never came is content)."""
        held, self._buffer = self._buffer, ""
        return ("", held) if self._state != "reasoning" else (held, "")
