"""Structured output: a request's tokens constrained to a JSON schema, any JSON object, a regex or a Lark grammar.

llguidance (numpy only, no torch) compiles the grammar against the model's own tokenizer.json; each completion gets a
matcher that gives the packed bitmask of the tokens allowed next (llguidance's layout: bit t % 32 of int32 word
t // 32, set = allowed), advances with every accepted token and rolls back (for speculative decoding). llguidance is
imported only when a request asks for structured output, so the runtime runs without it.

JSON is compiled without free whitespace between tokens (compact JSON: a model cannot pad it with endless blanks);
a schema's own "x-guidance" options (e.g. {"whitespace_flexible": true}) override that, as llguidance defines.
"""

from __future__ import annotations

import json as jsonlib
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import numpy as np

from ..errors import GenerationError

FIELDS = ("json", "json_object", "regex", "grammar")
JSON_DEFAULTS = {"whitespace_flexible": False}
COMPILED_GRAMMARS = 64  # grammars a compiler keeps compiled (a server sees the same schemas again and again)


def llguidance() -> ModuleType:
    """The llguidance module, imported on first use; a clear error where the extra is not installed."""
    try:
        import llguidance as module
    except ImportError:
        raise GenerationError("structured output needs llguidance: pip install 'llmlower[structured]'") from None
    return module


def _one_line(message: str) -> str:
    """An llguidance error as one line: without the parser state it may append, or the excerpts its carets mark."""
    kept: list[str] = []
    for line in message.split("\n<state>")[0].splitlines():
        if re.fullmatch(r"\s*\^[\^-]*\s*", line):
            kept = kept[:-1]  # the excerpt the caret points into
        elif line.strip():
            kept.append(line.strip())
    return " ".join(kept)


@dataclass(frozen=True)
class StructuredOutput:
    """What a request's output must match (vLLM's StructuredOutputsParams): exactly one of a JSON schema (a dict or
    its JSON text), any JSON object, a regex, or a Lark grammar in llguidance's dialect; checked on construction."""

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    grammar: str | None = None
    llguidance_grammar: str = field(init=False, repr=False, compare=False)  # what llguidance compiles

    def __post_init__(self) -> None:
        """Check that exactly one field is set, with the right type, and that llguidance accepts it."""
        given = self._given()
        if len(given) != 1:
            message = f"structured_output: exactly one of {', '.join(FIELDS)} must be set, got {given}"
            raise GenerationError(message, "structured_output")
        expected = {"json": (dict, str), "json_object": bool, "regex": str, "grammar": str}[self.kind]
        if not isinstance(getattr(self, self.kind), expected):
            kinds = "a dict or a str" if self.kind == "json" else f"a {expected.__name__}"
            message = f"structured_output.{self.kind} must be {kinds}, got {getattr(self, self.kind)!r}"
            raise GenerationError(message, f"structured_output.{self.kind}")
        object.__setattr__(self, "llguidance_grammar", self._compile())
        error = llguidance().LLMatcher.validate_grammar(self.llguidance_grammar)
        if error:
            raise self.error(error)

    def _given(self) -> list[str]:
        """The fields set (json_object counts unless it is False)."""
        return [name for name in FIELDS if getattr(self, name) is not (False if name == "json_object" else None)]

    @property
    def kind(self) -> str:
        """The field that is set: json, json_object, regex or grammar."""
        return self._given()[0]

    def error(self, message: str) -> GenerationError:
        """A GenerationError naming the field at fault, with llguidance's `message`."""
        what = {"json": "not a valid JSON schema: ", "regex": "not a valid regex: ", "grammar": "not a valid grammar: "}
        field = f"structured_output.{self.kind}"
        return GenerationError(f"{field}: {what.get(self.kind, '')}{_one_line(message)}", field)

    def _compile(self) -> str:
        """llguidance's grammar text for the field that is set."""
        matcher = llguidance().LLMatcher
        if self.regex is not None:
            return matcher.grammar_from_regex(self.regex)
        if self.grammar is not None:
            return matcher.grammar_from_lark(self.grammar)
        schema = {"type": "object"} if self.json_object else self.json
        try:
            if isinstance(schema, str) and not isinstance(jsonlib.loads(schema), dict):
                raise ValueError("a JSON schema is a JSON object")
            return matcher.grammar_from_json_schema(schema, defaults=JSON_DEFAULTS)
        except (ValueError, TypeError) as exc:
            raise self.error(str(exc)) from None


class Constraint:
    """One completion's place in its grammar: the tokens allowed next, advanced token by token, rolled back on
    request. Masks are `words` int32 long (ceil(vocab / 32)); tokens past the tokenizer's are never allowed."""

    def __init__(self, matcher: Any, words: int, output: StructuredOutput) -> None:
        self._matcher = matcher
        self._words = words
        self._output = output

    def mask(self) -> np.ndarray:
        """The packed bitmask of the tokens allowed next: int32 [ceil(vocab / 32)], bit t % 32 of word t // 32 set
        = token t allowed. A new array each call (masks of several positions may be held at once); llguidance
        writes it in place."""
        mask = np.empty(self._words, np.int32)
        self._matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
        return mask

    def accept(self, token: int) -> None:
        """Advance past `token`; a token the mask did not allow (or any token once finished) is a bug."""
        if self.finished or not self._matcher.consume_token(token):
            reason = "the grammar is complete" if self.finished else _one_line(self._matcher.get_error())
            raise GenerationError(f"structured_output.{self._output.kind}: token {token} is not allowed ({reason})")

    def masks_along(self, tokens: Sequence[int]) -> tuple[list[np.ndarray], int]:
        """The masks at each position of a speculative continuation: now, then after each of the leading `tokens`
        the grammar allows (how many: the second value); the constraint is left where it was."""
        masks = [self.mask()]
        for token in tokens[: self._matcher.validate_tokens(list(tokens))]:
            if self.finished:  # only EOS may follow, and it would not count as a token to roll back
                break
            self.accept(token)
            masks.append(self.mask())
        self.rollback(len(masks) - 1)
        return masks, len(masks) - 1

    def rollback(self, n: int) -> None:
        """Undo the last `n` accepted tokens."""
        if n < 0 or not self._matcher.rollback(n):
            raise GenerationError(f"structured_output: cannot roll back {n} tokens")

    @property
    def finished(self) -> bool:
        """The grammar is complete and allows nothing but stopping."""
        return self._matcher.is_stopped()


class GrammarCompiler:
    """Compiles structured outputs against one model's tokenizer (built from its tokenizer.json text, without
    transformers) into per-completion constraints; the model's EOS ids end every grammar. Thread-safe: a server
    compiles in worker threads while the engine thread takes the compiled grammars from the cache."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Iterable[int]) -> None:
        module = llguidance()
        tokenizer = module.LLTokenizer(tokenizer_json, eos_token=sorted(eos_token_ids) or None)
        if vocab_size > tokenizer.vocab_size:  # the model's logits are wider than the tokenizer: never allowed
            tokenizer = module.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=tokenizer.eos_tokens)
        self._tokenizer = tokenizer
        self._limits = module.LLParserLimits(verbose_errors=False)
        self._matcher = module.LLMatcher
        self.words = (tokenizer.vocab_size + 31) // 32  # >= the model's vocabulary
        self._compiled: OrderedDict[str, Any] = OrderedDict()  # llguidance grammar -> matcher at its start
        self._lock = threading.Lock()  # guards _compiled (a compile itself runs outside it)

    def check(self, output: StructuredOutput) -> None:
        """Compile `output` now (kept for constraints()), so that a bad one is refused before a request is queued."""
        self._start(output)

    def constraints(self, output: StructuredOutput, n: int) -> list[Constraint]:
        """`n` constraints for `output`, each with a matcher of its own."""
        start = self._start(output)
        return [Constraint(start.deep_copy(), self.words, output) for _ in range(n)]

    def _start(self, output: StructuredOutput) -> Any:
        """The compiled matcher of `output` at the grammar's start (the most recent COMPILED_GRAMMARS are kept)."""
        key = output.llguidance_grammar
        with self._lock:
            matcher = self._compiled.get(key)
        if matcher is None:
            matcher = self._matcher(self._tokenizer, key, log_level=0, limits=self._limits)
            if matcher.is_error():
                raise output.error(matcher.get_error())
        with self._lock:
            self._compiled[key] = self._compiled.pop(key, matcher)  # most recently used last
            while len(self._compiled) > COMPILED_GRAMMARS:
                self._compiled.popitem(last=False)
            return self._compiled[key]
