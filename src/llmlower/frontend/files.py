"""Checks on checkpoint files made before transformers sees them, so that errors name the file at fault."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import tokenizers

from ..errors import CheckpointError

GGUF_MAGIC = b"GGUF"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def read_json(path: Path, required: bool = True) -> dict[str, Any] | None:
    """A JSON object from `path`; None when an optional file is absent."""
    if not path.is_file():
        if required:
            raise CheckpointError(f"{path}: not found (a checkpoint directory needs {path.name})")
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data


def read_tokenizer_json(path: Path) -> str:
    """The text of a tokenizer.json that the tokenizers library loads, or a CheckpointError naming the file and
    what is wrong (truncated, not JSON, JSON but not a tokenizer)."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"{path}: not UTF-8 text ({exc})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc}; truncated?)") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object (a tokenizers tokenizer), found {type(data).__name__}")
    try:
        tokenizers.Tokenizer.from_str(text)
    except Exception as exc:  # the tokenizers library raises plain Exceptions
        raise CheckpointError(f"{path}: not a tokenizer the tokenizers library reads ({exc})") from None
    return text


def check_chat_template(template: object, source: Path) -> None:
    """A chat template must be a string jinja2 parses (it is rendered by the runtime, long after compiling)."""
    if not isinstance(template, str):
        raise CheckpointError(f"{source}: chat_template must be a string, found {type(template).__name__}")
    try:
        jinja2.Environment(extensions=[jinja2.ext.loopcontrols]).parse(template)
    except jinja2.TemplateSyntaxError as exc:
        raise CheckpointError(f"{source}: chat template line {exc.lineno}: {exc.message}") from None


def safetensors_shards(directory: Path) -> list[Path]:
    """The safetensors files holding the weights, each checked to be complete; never a pickle file."""
    index_path = directory / "model.safetensors.index.json"
    if index_path.is_file():
        index = read_json(index_path)
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index_path}: field 'weight_map' is missing or not an object")
        shards = sorted({directory / name for name in weight_map.values()})
        for shard in shards:
            if not shard.is_file():
                raise CheckpointError(f"{shard}: listed in {index_path.name} but not found")
    else:
        shards = sorted(directory.glob("*.safetensors"))
    if not shards:
        pickles = [p.name for p in directory.iterdir() if p.suffix in PICKLE_SUFFIXES]
        hint = (
            f" (found {', '.join(pickles)}: pickle files are never loaded; convert to safetensors)" if pickles else ""
        )
        raise CheckpointError(f"{directory}: no *.safetensors weights{hint}")
    for shard in shards:
        check_safetensors(shard)
    return shards


def check_safetensors(path: Path) -> None:
    """Raise if `path` is not a complete safetensors file: header readable, every tensor's bytes present."""
    size = path.stat().st_size
    with path.open("rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header)")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > size - 8:
            raise CheckpointError(f"{path}: truncated safetensors file (header of {header_len} bytes, file has {size})")
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise CheckpointError(f"{path}: corrupt safetensors header (not JSON)") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (not a JSON object)")
    ends = [entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"]
    needed = 8 + header_len + max(ends, default=0)
    if needed > size:
        raise CheckpointError(f"{path}: truncated safetensors file (tensors need {needed} bytes, file has {size})")


def check_gguf(path: Path) -> None:
    """Raise unless `path` starts with the GGUF magic."""
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise CheckpointError(
            f"{path}: not a GGUF file (starts with {magic!r}, expected {GGUF_MAGIC!r}); "
            "MODEL must be a checkpoint directory, a .gguf file or 'example'"
        )
