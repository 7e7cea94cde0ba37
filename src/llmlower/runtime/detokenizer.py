"""Streaming detokenization: token ids in, text deltas out, never a broken UTF-8 character, with stop handling.

IncrementalDetokenizer decodes a short window of recent tokens (the vLLM / TextStreamer technique) and holds text
back while it ends in U+FFFD, i.e. while a byte-fallback or byte-level token left a character incomplete.
TextStream adds EOS / stop-token / stop-string / length stops on top, holding back text that could still be the
start of a stop string, so that the concatenated deltas always equal the final text.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Any

from ..errors import GenerationError
from .markers import held_back
from .tokenizer import Tokenizer

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns one sequence's token ids, fed one at a time, into text deltas that are whole characters."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self._prefix_offset = 0  # start of the decode window: context so leading spaces and bytes decode as in full
        self._read_offset = 0  # tokens before this have been emitted as text

    def _decode(self, start: int, end: int | None = None) -> str:
        return self.tokenizer.decode(self.ids[start:end], skip_special_tokens=self.skip_special_tokens)

    def _advance(self, final: bool) -> str:
        """Emit the window's new text unless it ends in an incomplete character (or `final` forces it out)."""
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset)
        if len(new_text) <= len(prefix_text) or (new_text.endswith(REPLACEMENT) and not final):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)
        return new_text[len(prefix_text) :]

    def add(self, token_id: int) -> str:
        """The text that `token_id` completes (empty while a character is still incomplete)."""
        self.ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        """Whatever is still held at the end of the sequence (an incomplete character decodes as U+FFFD)."""
        return self._advance(final=True)


@dataclass(frozen=True)
class StreamDelta:
    """New text for one step, and whether (and why) the sequence just finished."""

    text: str
    finished: bool = False
    finish_reason: str | None = None  # "stop" (EOS / stop token / stop string) or "length"
    stop: str | int | None = None  # the stop string or stop token id that matched


class TextStream:
    """Streams one sequence's text with stop strings, stop token ids and a token limit; deltas add up to `text`."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        stop: Iterable[str] = (),
        stop_token_ids: Collection[int] = (),
        max_tokens: int | None = None,
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
    ) -> None:
        self.detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens)
        self.stop_strings = [s for s in stop if s]
        self.stop_token_ids = frozenset(stop_token_ids)
        self.max_tokens = max_tokens
        self.include_stop_str_in_output = include_stop_str_in_output
        self.num_tokens = 0
        self.finished = False
        self.finish_reason: str | None = None
        self.matched_stop: str | int | None = None
        self._text = ""  # detokenized text, including what is held back for stop strings
        self._emitted = 0  # length of self._text already returned in deltas

    @property
    def text(self) -> str:
        """The text emitted so far (the final text once finished)."""
        return self._text[: self._emitted]

    def _held(self) -> int:
        """Length of the longest end of the text that is a proper prefix of some stop string (it may still match)."""
        return held_back(self._text, self.stop_strings)

    def _push(self, new_text: str, end: tuple[str, str | int | None] | None = None) -> StreamDelta:
        """Append text; finish at the earliest stop string or at `end`, else emit what can no longer start a stop."""
        search_from = max(0, len(self._text) - max((len(s) for s in self.stop_strings), default=1) + 1)
        self._text += new_text
        matches = [(i, s) for s in self.stop_strings if (i := self._text.find(s, search_from)) >= 0]
        if matches:
            index, stop = min(matches, key=lambda match: match[0])
            self._text = self._text[: index + len(stop) if self.include_stop_str_in_output else index]
            end = ("stop", stop)
        start, self._emitted = self._emitted, len(self._text) if end else len(self._text) - self._held()
        if end:
            self.finished = True
            self.finish_reason, self.matched_stop = end
            return StreamDelta(self._text[start:], True, *end)
        return StreamDelta(self._text[start : self._emitted])

    def add(self, token_id: int) -> StreamDelta:
        """Feed the next generated token; the delta says what text to show and whether the sequence is done."""
        if self.finished:
            raise GenerationError(f"token {token_id} added after the sequence finished ({self.finish_reason})")
        self.num_tokens += 1
        if token_id in self.stop_token_ids:  # adds no text of its own; releases what was held
            return self._push(self.detokenizer.flush(), ("stop", token_id))
        text = self.detokenizer.add(token_id)
        if self.max_tokens is not None and self.num_tokens >= self.max_tokens:
            return self._push(text + self.detokenizer.flush(), ("length", None))
        return self._push(text)

    def finish(self, reason: str) -> StreamDelta:
        """End the sequence for a reason the caller enforces ("length": the context is full; "stop": its grammar is
        complete): release all held text."""
        if self.finished:
            raise GenerationError(f"the sequence already finished ({self.finish_reason})")
        return self._push(self.detokenizer.flush(), (reason, None))


def eos_token_ids(generation_config: dict[str, Any] | None, tokenizer: Tokenizer) -> set[int]:
    """The ids that end generation: generation_config's eos_token_id (an int or a list) plus the tokenizer's eos."""
    found: set[int] = set()
    configured = (generation_config or {}).get("eos_token_id")
    if isinstance(configured, int):
        found.add(configured)
    elif configured is not None:
        found.update(int(i) for i in configured)
    eos = tokenizer.special_tokens().get("eos_token")
    if eos:
        ids = tokenizer.encode(eos, add_special_tokens=False)
        if len(ids) == 1:
            found.add(ids[0])
    return found
