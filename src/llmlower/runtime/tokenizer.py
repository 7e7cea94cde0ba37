"""Tokenizer for the runtime: a fast tokenizer (tokenizers) plus the checkpoint's chat template (jinja2).

The template is rendered the way transformers renders it (sandboxed jinja2, trim_blocks, lstrip_blocks,
loop controls, `raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII text), so prompts match.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers

from ..errors import CheckpointError, GenerationError, LlmlowerError
from .artifact import ArtifactError, is_artifact, read_manifest
from .reasoning import ReasoningFormat, find_reasoning
from .tool_calls import GENERIC, ToolFormat, find_format

Message = dict[str, Any]


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _read_text(path: Path, error: type[LlmlowerError]) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise error(f"{path}: cannot be read as UTF-8 text ({exc})") from None


def _read_json(path: Path, error: type[LlmlowerError]) -> dict[str, Any]:
    try:
        data = json.loads(_read_text(path, error))
    except json.JSONDecodeError as exc:
        raise error(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise error(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data


class Tokenizer:
    """Encode, decode and chat-format text for one model."""

    def __init__(self, tokenizer_json: str, config: dict[str, Any], chat_template: str | None) -> None:
        self._tokenizer = tokenizers.Tokenizer.from_str(tokenizer_json)
        self.config = config
        self.chat_template = chat_template

    @classmethod
    def from_dir(cls, directory: str | Path) -> Tokenizer:
        """Read tokenizer.json, tokenizer_config.json and (if present) chat_template.jinja. In an artifact these
        must be files its manifest lists (hashed): an unlisted chat_template.jinja is refused, never read."""
        directory = Path(directory)
        error: type[LlmlowerError] = CheckpointError
        if is_artifact(directory):
            read_manifest(directory, verify=False, weights=False)  # refuses tokenizer files it does not list
            error = ArtifactError
        config_path = directory / "tokenizer_config.json"
        config = _read_json(config_path, error) if config_path.is_file() else {}
        template = config.pop("chat_template", None)
        template_path = directory / "chat_template.jinja"
        if template_path.is_file():
            template = _read_text(template_path, error)
        tokenizer_path = directory / "tokenizer.json"
        if not tokenizer_path.is_file():
            raise error(f"{tokenizer_path}: not found")
        text = _read_text(tokenizer_path, error)
        try:
            return cls(text, config, template)
        except Exception as exc:  # tokenizers raises its own Exception type for a malformed tokenizer.json
            raise error(f"{tokenizer_path}: not a tokenizers tokenizer ({exc})") from None

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def vocabulary(self) -> dict[str, int]:
        """Every token and its id (added tokens included): two tokenizers with equal ones encode alike."""
        return self._tokenizer.get_vocab(with_added_tokens=True)

    def to_json(self) -> str:
        """The tokenizer as tokenizer.json text (what grammar compilers build their own tokenizer from)."""
        return self._tokenizer.to_str()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def added_tokens(self, special_only: bool = False) -> dict[str, int]:
        """The tokens added to the vocabulary (markers such as `<|im_start|>` or `<tool_call>`) by text; special
        ones only where asked (decoding skips those unless told not to)."""
        added = self._tokenizer.get_added_tokens_decoder().items()
        return {token.content: i for i, token in added if token.special or not special_only}

    @cached_property
    def tool_format(self) -> ToolFormat:
        """How this model writes tool calls, read from its chat template (GENERIC where the template does not
        present tools or write calls as a name and JSON arguments)."""
        if not self.chat_template:
            return GENERIC
        probe = [{"type": "function", "function": {"name": "tool_probe_q", "parameters": {"type": "object"}}}]
        question = [{"role": "user", "content": "question"}]
        try:
            presents_tools = "tool_probe_q" in self.apply_chat_template(question, tools=probe)
        except GenerationError:
            return GENERIC
        special = list(self.added_tokens(special_only=True))
        render = lambda messages: self.apply_chat_template(messages, add_generation_prompt=False)  # noqa: E731
        found = find_format(render, special)
        return found if presents_tools and found is not None else GENERIC

    @cached_property
    def reasoning_format(self) -> ReasoningFormat | None:
        """The markers this model's template writes around reasoning (`<think>`, `</think>`), if any."""
        return find_reasoning(self.chat_template)

    def generation_prompt(self, **extra: Any) -> str:
        """The text the template adds to open the assistant's turn (with the template variables `extra`)."""
        question = [{"role": "user", "content": "question"}]
        opened = self.apply_chat_template(question, add_generation_prompt=True, **extra)
        closed = self.apply_chat_template(question, add_generation_prompt=False, **extra)
        return opened[len(closed) :] if opened.startswith(closed) else opened

    def special_tokens(self) -> dict[str, str]:
        """bos_token, eos_token, ... as strings (tokenizer_config.json may store them as objects)."""
        found = {}
        for key, value in self.config.items():
            if key.endswith("_token") and value is not None:
                found[key] = value.get("content") if isinstance(value, dict) else str(value)
        return found

    @cached_property
    def _template(self) -> jinja2.Template:
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        return env.from_string(self.chat_template)

    def apply_chat_template(self, messages: list[Message], add_generation_prompt: bool = True, **extra: Any) -> str:
        """The prompt text for a conversation, from the model's own chat template."""
        if not self.chat_template:
            raise GenerationError("the model has no chat template: pass a raw prompt (--raw) instead")
        for index, message in enumerate(messages):
            if not isinstance(message, dict) or "role" not in message:
                raise GenerationError(f"messages[{index}]: expected an object with 'role' and 'content'")
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                **self.special_tokens(),
                **extra,
            )
        except jinja2.exceptions.TemplateError as exc:
            raise GenerationError(f"chat template: {exc}") from None
