"""The compile-and-run path in a few calls: checkpoint -> Program through a pipeline -> Engine."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from .backends.torch import TorchExecutor
from .errors import LlmlowerError
from .frontend import LoadedModel, capture, load, resolve_model
from .ir import Program
from .passes import DEFAULT_PIPELINE, run_pipeline
from .passes.manager import PassSpec
from .runtime import Engine, Tokenizer
from .runtime.perplexity import PerplexityResult, perplexity


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
    executor = TorchExecutor(program, max_batch=max_batch, max_context=max_context)
    return Engine(executor, tokenizer_of(loaded), program.spec)


def compile_artifact(
    model: str | Path,
    output: str | Path,
    pipeline: Sequence[PassSpec] = DEFAULT_PIPELINE,
    *,
    backend: str = "onnx",
    target: str = "cpu",
    dtype: str = "float32",
    verify: bool = False,
) -> Path:
    """Compile MODEL into a deployable artifact directory at `output` (written atomically)."""
    if backend != "onnx":
        raise LlmlowerError(f"--backend {backend!r}: available backends are onnx (torch runs without compiling)")
    from .backends.onnx.artifact import build

    loaded, program = compile_program(model, pipeline, dtype=dtype, verify=verify)
    return build(program, output, target=target, write_extra=loaded.tokenizer.write)


def tokenizer_of(loaded: LoadedModel) -> Tokenizer:
    files = loaded.tokenizer
    return Tokenizer(files.tokenizer_json, files.config, files.chat_template)


def text_perplexity(
    model: str | Path,
    text: str,
    pipeline: Sequence[PassSpec],
    *,
    dtype: str = "float32",
    window: int = 512,
    stride: int | None = None,
) -> tuple[PerplexityResult, Program]:
    """Sliding-window perplexity of `text` under MODEL compiled with `pipeline` (which must keep every
    position's logits: no last_token_logits). The window is capped at the model's context; the stride
    defaults to half the window."""
    loaded, program = compile_program(model, pipeline, dtype=dtype)
    window = min(window, program.spec.max_positions)
    ids = tokenizer_of(loaded).encode(text, add_special_tokens=False)
    executor = TorchExecutor(program, max_batch=1, max_context=window)
    stride = stride or window // 2
    return perplexity(executor.prompt_logits, ids, window=window, stride=stride), program
