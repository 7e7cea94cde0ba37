"""The compile-and-run path in a few calls: checkpoint -> Program through a pipeline -> Engine."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from .backends.torch import TorchExecutor
from .frontend import LoadedModel, capture, load, resolve_model
from .ir import Program
from .passes import DEFAULT_PIPELINE, run_pipeline
from .passes.manager import PassSpec
from .runtime import Engine, Tokenizer


def compile_program(
    model: str | Path,
    pipeline: Sequence[PassSpec] = DEFAULT_PIPELINE,
    *,
    dtype: str = "float32",
    verify: bool = False,
    dump_dir: str | Path | None = None,
) -> tuple[LoadedModel, Program]:
    """Load MODEL (checkpoint directory, .gguf file or 'example'), capture it and run the pipeline."""
    loaded = load(resolve_model(model), dtype=dtype)
    program = run_pipeline(capture(loaded), pipeline, verify=verify, dump_dir=dump_dir)
    return loaded, program


def load_engine(
    model: str | Path,
    pipeline: Sequence[PassSpec] = DEFAULT_PIPELINE,
    *,
    dtype: str = "float32",
    max_batch: int = 4,
    max_context: int | None = 2048,
    verify: bool = False,
) -> Engine:
    """An Engine on the torch reference backend for MODEL."""
    loaded, program = compile_program(model, pipeline, dtype=dtype, verify=verify)
    files = loaded.tokenizer
    tokenizer = Tokenizer(files.tokenizer_json, files.config, files.chat_template)
    return Engine(TorchExecutor(program, max_batch=max_batch, max_context=max_context), tokenizer, program.spec)
