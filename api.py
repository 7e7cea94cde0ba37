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
from .runtime.artifact import is_artifact, read_manifest
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
    dtype: str | None = None,
    accuracy_level: int | None = None,
    cuda_arch: str | None = None,
    cpu: str | None = None,
    verify: bool = False,
) -> Path:
    """Compile MODEL into a deployable artifact directory at `output` (written atomically) with the onnx backend
    (`accuracy_level`: MatMulNBits', default 4) or the tvm one (`cuda_arch` for cuda, e.g. sm_90; `cpu`: the
    LLVM CPU name, default this machine's). The dtype defaults to float32 on cpu and float16 on cuda."""
    if backend == "onnx":
        from .backends.onnx.artifact import build, check_target

        if cuda_arch or cpu:
            raise LlmlowerError("--cuda-arch and --cpu are options of --backend tvm")
        check_target(target)  # before the minutes of capture and passes
        options = {"accuracy_level": 4 if accuracy_level is None else accuracy_level}
    elif backend == "tvm":
        from .backends.tvm import check_target
        from .backends.tvm.artifact import build

        if accuracy_level is not None:
            raise LlmlowerError("--accuracy-level is an option of --backend onnx")
        check_target(target, cuda_arch)
        options = {"cuda_arch": cuda_arch, "cpu": cpu}
    else:
        raise LlmlowerError(f"--backend {backend!r}: available backends are onnx, tvm (torch runs without compiling)")
    dtype = dtype or ("float16" if target == "cuda" else "float32")
    loaded, program = compile_program(model, pipeline, dtype=dtype, verify=verify)

    def write_model_files(directory: Path) -> None:
        loaded.tokenizer.write(directory)
        loaded.module.generation_config.to_json_file(directory / "generation_config.json")

    return build(program, output, target=target, write_extra=write_model_files, **options)


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
) -> tuple[PerplexityResult, list[dict]]:
    """Sliding-window perplexity of `text` under MODEL compiled with `pipeline` (which must keep every
    position's logits: no last_token_logits), or under an artifact compiled that way (the pipeline is then
    the artifact's). The window is capped at the model's context; the stride defaults to half the window.
    Returns the result and the passes that ran (name, options, stats)."""
    if is_artifact(model):
        engine = Engine.load(model, max_batch=1, max_context=window)
        executor, tokenizer, history = engine.executor, engine.tokenizer, read_manifest(model, verify=False)["pipeline"]
        window = min(window, executor.max_context)
    else:
        loaded, program = compile_program(model, pipeline, dtype=dtype)
        window = min(window, program.spec.max_positions)
        executor, tokenizer = TorchExecutor(program, max_batch=1, max_context=window), tokenizer_of(loaded)
        history = [record.to_dict() for record in program.history]
    ids = tokenizer.encode(text, add_special_tokens=False)
    result = perplexity(executor.prompt_logits, ids, window=window, stride=stride or window // 2)
    return result, history
