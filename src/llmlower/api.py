"""The compile-and-run path in a few calls: checkpoint -> Program through a pipeline -> Engine."""

from __future__ import annotations

import functools
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .backends.failures import backend_errors
from .backends.manifest import cache_dtype
from .backends.registry import BACKENDS, get_backend
from .backends.torch.program_executor import TorchExecutor
from .errors import ArgumentError, LlmlowerError
from .frontend import LoadedModel, cache_dir, capture, load, resolve_model
from .frontend.calibration import calibration_ids
from .ir import Program
from .passes import DEFAULT_PIPELINE, PASSES, run_pipeline, with_kv_layout
from .passes.calibration_store import calibration_store
from .passes.manager import PassSpec, pass_specs, pass_steps
from .progress import stage
from .runtime import Engine, EngineConfig, Tokenizer
from .runtime.artifact import MANIFEST, check_output, draft_dir_name, draft_key, is_artifact, read_manifest, sha256
from .runtime.block_manager import kv_pool_blocks
from .runtime.perplexity import PerplexityResult, check_window, perplexity
from .step_io import DEFAULT_BLOCK_SIZE, KV_CACHE_DTYPES, KVLayout
from .verify_artifact import verify_artifact

CALIBRATION_DIR = "calibration"  # under the cache directory: calibrated passes' results (passes.calibration_store)


def compile_program(
    model: str | Path,
    pipeline: Sequence[PassSpec] = DEFAULT_PIPELINE,
    *,
    dtype: str = "float32",
    kv_layout: KVLayout | None = None,
    block_size: int | None = None,
    verify: bool = False,
    dump_dir: str | Path | None = None,
    kv_cache_dtype: str = "auto",
) -> tuple[LoadedModel, Program]:
    """Load MODEL (checkpoint directory, .gguf file or 'example'), capture it and run the pipeline; with
    `kv_layout`, the pipeline is first adapted to it (PAGED adds paged_attention with `block_size`); a
    `kv_cache_dtype` other than the model's adds the kv_cache_dtype pass last (with_kv_cache_dtype); calibrated
    passes get their text (with_calibration)."""
    check_block_size(block_size)
    if kv_layout is not None:
        pipeline = with_kv_layout(pipeline, kv_layout, block_size)
    loaded = load(resolve_model(model), dtype=dtype)
    pipeline = with_calibration(with_kv_cache_dtype(pipeline, kv_cache_dtype, dtype), loaded)
    return loaded, run_calibrated(loaded, pipeline, verify, dump_dir)


def run_calibrated(
    loaded: LoadedModel, pipeline: Sequence[PassSpec], verify: bool, dump_dir: str | Path | None = None
) -> Program:
    """The pipeline run on a fresh capture of the model, its calibrated passes' results kept in (and taken from)
    the cache's calibration store."""
    with calibration_store(cache_dir() / CALIBRATION_DIR):
        return run_pipeline(capture(loaded), pipeline, verify=verify, dump_dir=dump_dir)


def with_kv_cache_dtype(pipeline: Sequence[PassSpec], kv_cache_dtype: str, dtype: str) -> list[PassSpec]:
    """The pipeline with, for a cache in another dtype than the model's `dtype`, the kv_cache_dtype pass last."""
    if kv_cache_dtype in ("auto", dtype):
        return list(pipeline)
    return [*pipeline, ("kv_cache_dtype", {"dtype": kv_cache_dtype})]


def with_calibration(pipeline: Sequence[PassSpec], loaded: LoadedModel) -> list[PassSpec]:
    """The pipeline with each calibrated pass (awq, kv_cache_dtype) given frontend.calibration's text in the
    model's own tokens where its options leave `calibration` out."""
    steps = pass_steps(pipeline)
    uncalibrated = [o for name, o in steps if name in PASSES and PASSES[name].calibrated and "calibration" not in o]
    if uncalibrated:
        calibration = calibration_ids(tokenizer_of(loaded))
        for options in uncalibrated:
            options["calibration"] = calibration
    return pass_specs(steps)


def check_draft_layers(draft_layers: int | Sequence[int] | None, num_layers: int | None = None) -> list[int]:
    """The distinct layer counts of the self-drafts asked for (--draft-layers K, repeatable), each from 1 to the
    model's `num_layers` - 1 (checked once it is known)."""
    if draft_layers is None:
        return []
    counts = [draft_layers] if isinstance(draft_layers, int) else list(draft_layers)
    for k in counts:
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ArgumentError(f"--draft-layers {k!r}: must be a positive number of decoder layers")
        if num_layers is not None and k >= num_layers:
            raise ArgumentError(
                f"--draft-layers {k}: the model has {num_layers} decoder layers; a self-draft keeps 1 to "
                f"{num_layers - 1} of them"
            )
    return sorted(set(counts))


# passes that rewrite within layers only; eager_attention also drops what an eager model's layers share (ALiBi
# biases and masks built once), so draft_layers runs after them
BEFORE_DRAFT = ("canonicalize", "eager_attention")


def draft_pipeline(pipeline: Sequence[PassSpec], layers: int) -> list[PassSpec]:
    """The target's pipeline with draft_layers after its leading BEFORE_DRAFT passes, before fusions merge layers."""
    names = [step if isinstance(step, str) else step[0] for step in pipeline]
    if "draft_layers" in names:
        raise ArgumentError("--draft-layers: the pipeline already has draft_layers (leave it out of --passes)")
    at = 0
    while at < len(names) and names[at] in BEFORE_DRAFT:
        at += 1
    return [*pipeline[:at], ("draft_layers", {"layers": layers}), *pipeline[at:]]


def check_kv_cache_dtype(kv_cache_dtype: str, dtype: str, backend: str, target: str) -> None:
    """--kv-cache-dtype against the model's dtype and what the backend's kernels take, before anything is loaded."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ArgumentError(f"--kv-cache-dtype {kv_cache_dtype!r}: one of {', '.join(KV_CACHE_DTYPES)}")
    if kv_cache_dtype in ("auto", dtype):
        return
    if kv_cache_dtype != "int8" and dtype != "float32":
        raise ArgumentError(
            f"--kv-cache-dtype {kv_cache_dtype}: a {dtype} model keeps its cache in {dtype} or int8; a "
            f"{kv_cache_dtype} cache is for float32 models"
        )
    if kv_cache_dtype not in get_backend(backend).kv_cache_dtypes.get(target, ()):
        takers = [
            f"{b.name} --target {t}"
            for b in BACKENDS.values()
            for t, taken in b.kv_cache_dtypes.items()
            if kv_cache_dtype in taken
        ]
        raise ArgumentError(
            f"--kv-cache-dtype {kv_cache_dtype}: the attention kernels of --backend {backend} --target {target} "
            f"do not read {kv_cache_dtype} caches of a {dtype} model; these do: {', '.join(takers)}"
        )


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
    kv_cache_dtype: str = "auto",
    **limits: int | bool | None,
) -> Engine:
    """An Engine on the torch reference backend for MODEL (a paged program, its KV pools in `kv_cache_dtype`);
    `config` or EngineConfig's fields as keywords (max_num_seqs=4, max_context=512, num_blocks=..., ...) set its
    limits. A speculative config's draft is a checkpoint here (draft:PATH), or MODEL through the draft_layers pass
    (self:K), with the same cache dtype."""
    config = config or EngineConfig(**limits)
    check_kv_cache_dtype(kv_cache_dtype, dtype, "torch", "cpu")
    layout = get_backend("torch").layout("cpu")
    block_size = config.block_size or DEFAULT_BLOCK_SIZE
    compile_options = {"dtype": dtype, "kv_layout": layout, "block_size": block_size, "kv_cache_dtype": kv_cache_dtype}
    loaded, program = compile_program(model, pipeline, verify=verify, **compile_options)
    spec = program.spec
    context = min(config.max_context or spec.max_positions, spec.max_positions)
    blocks = kv_pool_blocks(
        spec.kv_bytes_per_token(cache_dtype(program)),
        block_size,
        config.max_num_seqs,
        context,
        config.num_blocks,
        config.kv_cache_memory,
        state_bytes=spec.state_bytes,
    )
    executor = TorchExecutor(program, max_context=context, num_blocks=blocks)
    draft = None
    speculative = config.speculative
    if speculative is not None and speculative.method != "ngram":
        self_draft = speculative.method == "self"
        draft_model = model if self_draft else speculative.draft
        steps = draft_pipeline(pipeline, speculative.layers) if self_draft else pipeline
        _, draft_program = compile_program(draft_model, steps, **compile_options)
        draft = TorchExecutor(draft_program, max_context=context, num_blocks=blocks)
    return Engine(executor, tokenizer_of(loaded), spec, config=config, draft=draft)


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
    vm_exec: str | None = None,
    dialect: str | None = None,
    static_dims: dict[str, int] | None = None,
    block_size: int | None = None,
    verify: bool = False,
    check_artifact: bool = False,
    write_extra: Callable[[Path], None] | None = None,
    draft_layers: int | Sequence[int] | None = None,
    kv_cache_dtype: str = "auto",
    recipe: dict[str, Any] | None = None,
) -> Path:
    """Compile MODEL into a deployable artifact directory at `output` (written atomically) with the onnx backend
    (`accuracy_level`: MatMulNBits', default 4), the tvm one (`accuracy_level` 4, the cpu default: grouped int4 / int8
    matmuls with int8 activations, 0: float32; `cuda_arch` for cuda, e.g. sm_90; `cpu`: the LLVM CPU name, default
    this machine's; `vm_exec`: compiled, the cpu default, or bytecode, the cuda one) or the mlir one (`dialect`:
    torch, linalg (default), stablehlo or tosa; `static_dims`: sizes fixed in the module, e.g. {"batch": 1,
    "tokens": 16}, a decode step's for tosa). The dtype defaults to float32 on cpu and float16 on cuda; the
    pipeline gets the KV layout the backend runs on the target (backends.registry). `write_extra(directory)` adds
    files of the caller's to the artifact before it is hashed (the compile cache's key). `verify` checks each pass
    against the one before and then the built artifact, run by its own executor, against the torch reference
    (verify_artifact): one that differs beyond its backend's tolerance is refused and nothing is written.
    `check_artifact` runs that last check alone (seconds: a prefill and a few decode steps of three sequences on
    both executors), what the compile cache does for every model generate, chat and serve compile.

    `draft_layers` (K, or several): also compile a self-draft for speculative decoding per K, the model's first K
    decoder layers with its final norm and LM head (the draft_layers pass, first in the same pipeline, backend,
    target, dtype and block size, so its KV layout is the target's), as a complete artifact inside the target's at
    `output/draft-layers-K/`, listed in the target's manifest under `drafts` (runtime.artifact.draft_artifact).

    `kv_cache_dtype`: auto (the model's dtype), or another dtype by the kv_cache_dtype pass: float16 / bfloat16
    for a float32 model, int8 (its scales calibrated on frontend.calibration's text); each backend's
    kv_cache_dtypes say which its kernels take.

    `recipe`: the recipe the settings came from and why (recipes.Choice.to_dict()), recorded in the manifest; the
    settings themselves are the arguments (compile_model resolves a recipe's name into them)."""
    check_output(output)  # a file or someone's directory is refused now, not replaced after compiling
    drafts = check_draft_layers(draft_layers)
    for k in drafts:
        draft_pipeline(pipeline, k)  # a pipeline that has draft_layers already is refused before loading
    entry = get_backend(backend)
    if entry.compiler is None:
        compilers = ", ".join(name for name, b in BACKENDS.items() if b.compiler)
        raise LlmlowerError(f"--backend {backend}: {entry.summary}; compile with one of {compilers}")
    layout = entry.layout(target)  # before the minutes of capture and passes
    given = {
        name: value
        for name, value in (
            ("accuracy_level", accuracy_level),
            ("cuda_arch", cuda_arch),
            ("cpu", cpu),
            ("vm_exec", vm_exec),
            ("dialect", dialect),
            ("static_dims", static_dims),
        )
        if value is not None
    }
    for name in given:
        if name not in entry.options:
            owners = [b.name for b in BACKENDS.values() if name in b.options]
            flag = "--" + name.replace("_", "-")
            raise LlmlowerError(f"{flag}: one of the options of --backend {', '.join(owners)}")
    if entry.check is not None:
        entry.load(entry.check)(target, given)
    dtype = dtype or ("float16" if target == "cuda" else "float32")
    check_block_size(block_size)
    check_kv_cache_dtype(kv_cache_dtype, dtype, backend, target)
    pipeline = with_kv_layout(pipeline, layout, block_size)
    loaded = load(resolve_model(model), dtype=dtype)
    check_draft_layers(drafts, loaded.spec.num_layers)  # before minutes of compiling
    pipeline = with_calibration(with_kv_cache_dtype(pipeline, kv_cache_dtype, dtype), loaded)
    program = run_calibrated(loaded, pipeline, verify)

    def write_tokenizer(directory: Path) -> None:
        loaded.tokenizer.write(directory)
        loaded.module.generation_config.to_json_file(directory / "generation_config.json")

    def build(built: Program, directory: Path | str, **extra: Any) -> Path:
        """The backend's build of the target's program or a draft's, with this compile's target and options."""
        checked = verify or check_artifact
        if recipe is not None:
            extra["manifest_extra"] = {"recipe": recipe, **extra.get("manifest_extra", {})}
        return build_checked(entry.name, built, directory, verify=checked, target=target, **extra, **given)

    if not drafts:

        def write_model_files(directory: Path) -> None:
            write_tokenizer(directory)
            if write_extra is not None:
                write_extra(directory)

        return build(program, output, write_extra=write_model_files)
    output = Path(output).expanduser()
    output.parent.mkdir(parents=True, exist_ok=True)
    # built beside the output (same file system: moved into the target's staging directory by a rename)
    scratch = Path(tempfile.mkdtemp(prefix=f".{output.name}.drafts.", dir=output.parent))
    try:
        built = {}
        for k in drafts:
            name = draft_dir_name(k)
            with stage(f"self-draft {name}: the first {k} of {program.spec.num_layers} decoder layers") as shown:
                draft = run_calibrated(loaded, draft_pipeline(pipeline, k), verify)
                check_same_kv_layout(program, draft)
                about = {"draft": {"method": "early_exit", "layers": k, "target_layers": program.spec.num_layers}}
                built[k] = build(draft, scratch / name, write_extra=write_tokenizer, manifest_extra=about)
                shown.detail = f"{draft.parameters_numel():,} of {program.parameters_numel():,} parameters"

        def write_with_drafts(directory: Path) -> None:
            write_tokenizer(directory)
            for path in built.values():
                shutil.move(path, directory / path.name)
            if write_extra is not None:
                write_extra(directory)

        listed = {
            draft_key(k): {
                "path": path.name,
                "file": f"{path.name}/{MANIFEST}",  # in the target's hashed files, like every `file` field
                "layers": k,
                "manifest_sha256": sha256(path / MANIFEST),
            }
            for k, path in built.items()
        }
        return build(program, output, write_extra=write_with_drafts, manifest_extra={"drafts": listed})
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def build_checked(backend: str, program: Program, directory: Path | str, verify: bool, **options: Any) -> Path:
    """The backend's build of `program` into `directory` (options: target, write_extra, ... and the backend's),
    its toolkit's errors made one line (backends.failures); with `verify`, the artifact is run against the torch
    reference before it is moved into place (verify_artifact) and refused, nothing written, when it differs."""
    check = functools.partial(verify_artifact, program) if verify else None
    with backend_errors(backend, program):
        entry = get_backend(backend)
        return entry.load(entry.compiler)(program, directory, check_staged=check, **options)


def check_same_kv_layout(target: Program, draft: Program) -> None:
    """A self-draft runs on the target's block tables: same KV layout, block size, kv heads and head size."""
    layouts = [
        (p.kv_layout, p.block_size if p.kv_layout is KVLayout.PAGED else None, p.spec.num_kv_heads, p.spec.head_dim)
        for p in (target, draft)
    ]
    if layouts[0] != layouts[1]:
        raise LlmlowerError(f"the self-draft's KV layout {layouts[1]} differs from the target's {layouts[0]}")


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
    kv_cache_dtype: str = "auto",
    decode: bool = False,
) -> tuple[PerplexityResult, list[dict]]:
    """Sliding-window perplexity of `text` under MODEL compiled with `pipeline` (which must keep every
    position's logits: no last_token_logits) and its KV cache in `kv_cache_dtype`, or under an artifact compiled
    that way (the pipeline is then the artifact's). `decode`: each window scored one token per step instead, as
    generation runs (any artifact; a window's tokens are that many steps). The window is capped at the model's
    context; the stride defaults to half the window. Returns the result and the passes that ran (name, options,
    stats)."""
    check_kv_cache_dtype(kv_cache_dtype, dtype, "torch", "cpu")
    if stride is not None:
        check_window(window, stride)  # before the model loads
    elif window < 2:
        check_window(window, 1)
    if is_artifact(model):
        engine = Engine.load(model, EngineConfig(max_num_seqs=1, max_context=window))
        executor, tokenizer, history = engine.executor, engine.tokenizer, read_manifest(model, verify=False)["pipeline"]
        context = executor.max_context
    else:
        # the torch reference scores in the SLOTS layout: it carries a hybrid model's recurrent state, PAGED not yet
        loaded, program = compile_program(
            model, pipeline, dtype=dtype, kv_layout=KVLayout.SLOTS, kv_cache_dtype=kv_cache_dtype
        )
        context = program.spec.max_positions
        executor, tokenizer = TorchExecutor(program, max_context=min(window, context)), tokenizer_of(loaded)
        history = [record.to_dict() for record in program.history]
    note = ""
    if window > context:
        window, note = context, f" (--window {window} is capped at the model's context of {context} tokens)"
    stride = stride or window // 2
    check_window(window, stride, note)
    ids = tokenizer.encode(text, add_special_tokens=False)
    scorer = executor.decode_logits if decode else executor.prompt_logits
    result = perplexity(scorer, ids, window=window, stride=stride)
    return result, history


def recipe_pipeline(settings: dict[str, Any], lora: dict[str, Any] | None = None) -> list[PassSpec]:
    """The default pipeline with a recipe's quantization (recipes.Choice.settings) and `lora`'s adapter slots (the
    lora pass's options: rank, max_loras, targets)."""
    from .passes import build_pipeline

    return build_pipeline(
        None,
        settings["quant"] or "none",
        lm_head_bits=settings["lm_head_bits"],
        awq=settings["awq"],
        gptq=settings["gptq"],
        scale_dtype=settings["scale_dtype"],
        lora=lora,
    )


def compile_model(
    model: str | Path, output: str | Path, recipe: str = "auto", lora: dict[str, Any] | None = None, **options: Any
) -> Path:
    """Compile MODEL into an artifact at `output` by a recipe (a name in recipes.RECIPES, or auto: the fastest
    within the quality gate here): backend=, quant=, gptq=, awq=, scale_dtype=, lm_head_bits= and kv_cache_dtype=
    given as keywords win over the recipe's; `lora`: adapter slots (rank, max_loras, targets); the other keywords
    are compile_artifact's. The choice and why are in the manifest's `recipe`."""
    from .recipes import choose, recipe_settings

    choice = choose(recipe, {name: options.pop(name) for name in recipe_settings() if name in options})
    settings = choice.settings
    return compile_artifact(
        model,
        output,
        recipe_pipeline(settings, lora),
        backend=settings["backend"],
        kv_cache_dtype=settings["kv_cache_dtype"],
        recipe=choice.to_dict(),
        **options,
    )


def load_model(
    model: str | Path,
    recipe: str = "auto",
    config: EngineConfig | None = None,
    *,
    threads: int = 0,
    notify: Callable[[str], None] = lambda message: None,
    **settings: Any,
) -> Engine:
    """An Engine for MODEL (a checkpoint, a .gguf file or 'example') compiled by a recipe as compile_model says,
    once: the artifact is cached (compile_cache) and loaded from there the next time. `notify` gets a line when it
    compiles or waits for another process to."""
    from .compile_cache import CompileRequest, load_compiled
    from .recipes import choose

    choice = choose(recipe, settings)
    chosen = choice.settings
    backend = get_backend(chosen["backend"])
    if backend.compiler is None:
        raise ArgumentError(f"backend {backend.name!r} compiles no artifact: use load_engine for the torch reference")
    check_kv_cache_dtype(chosen["kv_cache_dtype"], "float32", backend.name, "cpu")
    config = config or EngineConfig()
    block_size = config.block_size if backend.layout("cpu") is KVLayout.PAGED else None
    pipeline = tuple(recipe_pipeline(chosen))
    request = CompileRequest(
        pipeline,
        chosen["quant"] or "none",
        backend.name,
        block_size=block_size,
        kv_cache_dtype=chosen["kv_cache_dtype"],
        recipe=choice.to_dict(),
    )
    notify(choice.line())
    return load_compiled(model, request, lambda path: Engine.load(path, config, threads=threads), notify=notify)
