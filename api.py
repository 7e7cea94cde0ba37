"""The compile-and-run path in a few calls: checkpoint -> Program through a pipeline -> Engine."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from .backends.torch import TorchExecutor
from .backends.torch.executor import DEFAULT_BLOCK_SIZE
from .errors import ArgumentError, LlmlowerError
from .frontend import LoadedModel, capture, load, resolve_model
from .ir import Program
from .passes import DEFAULT_PIPELINE, run_pipeline, with_kv_layout
from .passes.manager import PassSpec
from .runtime import Engine, EngineConfig, Tokenizer
from .runtime.artifact import check_output, is_artifact, read_manifest
from .runtime.backends import BACKENDS, get_backend, load_symbol
from .runtime.block_manager import kv_pool_blocks
from .runtime.perplexity import PerplexityResult, check_window, perplexity
from .step_io import KVLayout


def compile_program(
    model: str | Path,
    pipeline: Sequence[PassSpec] = DEFAULT_PIPELINE,
    *,
    dtype: str = "float32",
    kv_layout: KVLayout | None = None,
    block_size: int | None = None,
    verify: bool = False,
    dump_dir: str | Path | None = None,
) -> tuple[LoadedModel, Program]:
    """Load MODEL (checkpoint directory, .gguf file or 'example'), capture it and run the pipeline; with
    `kv_layout`, the pipeline is first adapted to it (PAGED adds paged_attention with `block_size`)."""
    check_block_size(block_size)
    if kv_layout is not None:
        pipeline = with_kv_layout(pipeline, kv_layout, block_size)
    loaded = load(resolve_model(model), dtype=dtype)
    program = run_pipeline(capture(loaded), pipeline, verify=verify, dump_dir=dump_dir)
    return loaded, program


def check_block_size(block_size: int | None) -> None:
    """A paged KV block holds a power of two of tokens (the paged_attention pass's rule), checked before loading."""
    if block_size is not None and (isinstance(block_size, bool) or block_size < 1 or block_size & (block_size - 1)):
        raise ArgumentError(f"--block-size {block_size}: must be a power of two (e.g. 16)")


def load_engine(
    model: str | Path,
    pipeline: Sequence[PassSpec] = DEFAULT_PIPELINE,
    *,
    dtype: str = "float32",
    config: EngineConfig | None = None,
    verify: bool = False,
    **limits: int | bool | None,
) -> Engine:
    """An Engine on the torch reference backend for MODEL (a paged program); `config` or EngineConfig's
    fields as keywords (max_num_seqs=4, max_context=512, num_blocks=..., ...) set its limits."""
    config = config or EngineConfig(**limits)
    layout = get_backend("torch").layout("cpu")
    block_size = config.block_size or DEFAULT_BLOCK_SIZE
    loaded, program = compile_program(
        model, pipeline, dtype=dtype, kv_layout=layout, block_size=block_size, verify=verify
    )
    spec = program.spec
    context = min(config.max_context or spec.max_positions, spec.max_positions)
    blocks = kv_pool_blocks(
        spec.kv_bytes_per_token(), block_size, config.max_num_seqs, context, config.num_blocks, config.kv_cache_memory
    )
    executor = TorchExecutor(program, max_context=context, num_blocks=blocks)
    return Engine(executor, tokenizer_of(loaded), spec, config=config)


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
    block_size: int | None = None,
    verify: bool = False,
    write_extra: Callable[[Path], None] | None = None,
) -> Path:
    """Compile MODEL into a deployable artifact directory at `output` (written atomically) with the onnx backend
    (`accuracy_level`: MatMulNBits', default 4) or the tvm one (`cuda_arch` for cuda, e.g. sm_90; `cpu`: the
    LLVM CPU name, default this machine's). The dtype defaults to float32 on cpu and float16 on cuda; the
    pipeline gets the KV layout the backend runs on the target (runtime.backends). `write_extra(directory)` adds
    files of the caller's to the artifact before it is hashed (the compile cache's key)."""
    check_output(output)  # a file or someone's directory is refused now, not replaced after compiling
    entry = get_backend(backend)
    if entry.compiler is None:
        raise LlmlowerError(f"--backend {backend}: {entry.summary}; compile with one of onnx, tvm")
    layout = entry.layout(target)  # before the minutes of capture and passes
    given = {
        name: value
        for name, value in (("accuracy_level", accuracy_level), ("cuda_arch", cuda_arch), ("cpu", cpu))
        if value is not None
    }
    for name in given:
        if name not in entry.options:
            owners = [b.name for b in BACKENDS.values() if name in b.options]
            flag = "--" + name.replace("_", "-")
            raise LlmlowerError(f"{flag}: one of the options of --backend {', '.join(owners)}")
    if entry.check is not None:
        load_symbol(entry.check)(target, given)
    dtype = dtype or ("float16" if target == "cuda" else "float32")
    loaded, program = compile_program(
        model, pipeline, dtype=dtype, kv_layout=layout, block_size=block_size, verify=verify
    )

    def write_model_files(directory: Path) -> None:
        loaded.tokenizer.write(directory)
        loaded.module.generation_config.to_json_file(directory / "generation_config.json")
        if write_extra is not None:
            write_extra(directory)

    build = load_symbol(entry.compiler)
    return build(program, output, target=target, write_extra=write_model_files, **given)


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
    if stride is not None:
        check_window(window, stride)  # before the model loads
    elif window < 2:
        check_window(window, 1)
    if is_artifact(model):
        engine = Engine.load(model, EngineConfig(max_num_seqs=1, max_context=window))
        executor, tokenizer, history = engine.executor, engine.tokenizer, read_manifest(model, verify=False)["pipeline"]
        context = executor.max_context
    else:
        loaded, program = compile_program(model, pipeline, dtype=dtype, kv_layout=KVLayout.PAGED)
        context = program.spec.max_positions
        executor, tokenizer = TorchExecutor(program, max_context=min(window, context)), tokenizer_of(loaded)
        history = [record.to_dict() for record in program.history]
    note = ""
    if window > context:
        window, note = context, f" (--window {window} is capped at the model's context of {context} tokens)"
    stride = stride or window // 2
    check_window(window, stride, note)
    ids = tokenizer.encode(text, add_special_tokens=False)
    result = perplexity(executor.prompt_logits, ids, window=window, stride=stride)
    return result, history
