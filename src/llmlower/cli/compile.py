"""`llmlower compile`: a model into a deployable artifact directory."""

from __future__ import annotations

import argparse
import sys
import time

from rich.console import Console

from ..backends.registry import BACKENDS
from ..compile_cache import compile_time
from .engine_args import apply_recipe, pass_pipeline
from .options import MODEL_HELP, VERIFY_HELP, add_pipeline_options


def add_compile_parser(sub: argparse._SubParsersAction) -> None:
    """The `compile` command and its options."""
    comp = sub.add_parser("compile", help="compile a model into a deployable artifact directory")
    comp.add_argument("model", help=MODEL_HELP)
    comp.add_argument("-o", "--output", required=True, help="the artifact directory to write")
    compilers = [name for name, backend in BACKENDS.items() if backend.compiler]
    comp.add_argument(
        "--backend",
        choices=compilers,
        help="onnx: ONNX Runtime; tvm: Apache TVM; mlir: MLIR through torch-mlir (for other MLIR compilers); "
        "default: the recipe's (--target cuda: onnx)",
    )
    comp.add_argument(
        "--target",
        default="cpu",
        help="cpu or cuda (the recipes are for the CPU: cuda compiles the flags alone unless --recipe)",
    )
    comp.add_argument(
        "--accuracy-level",
        type=int,
        choices=range(5),
        help="onnx: MatMulNBits compute type on CPU: 4 = int8 activations (default, fastest), 0 = float32; tvm, cpu: "
        "4 = grouped int4 and int8 matmuls with int8 activations (default, fastest), "
        "0 = float32",
    )
    comp.add_argument("--cuda-arch", help="tvm, cuda: GPU architecture to build for (sm_80 default, sm_89, sm_90)")
    comp.add_argument("--cpu", help="tvm, cpu: LLVM CPU name to build for (default: this machine's, e.g. znver3)")
    comp.add_argument(
        "--vm-exec",
        choices=("compiled", "bytecode"),
        help="tvm: how TVM's VM runs a step's kernel calls: compiled to native code (cpu default) or interpreted "
        "bytecode (cuda default; lets benchmarks/profile_step.py time each call)",
    )
    comp.add_argument("--dialect", help="mlir: the dialect of the module: torch, linalg (default), stablehlo, tosa")
    comp.add_argument(
        "--static-dims",
        type=parse_dims,
        metavar="NAME=SIZE,...",
        help="mlir: fix dimensions of the step (batch, tokens, context), e.g. batch=1,tokens=16; tosa has no dynamic "
        "sizes and fixes a decode step unless told (batch=1,tokens=1,context=the model's)",
    )
    comp.add_argument("--block-size", type=int, help="KV block size of a paged artifact (tvm, onnx cuda; default 16)")
    comp.add_argument("--verify", action="store_true", help=VERIFY_HELP)
    comp.add_argument(
        "--draft-layers",
        type=int,
        action="append",
        metavar="K",
        help="also compile a self-draft for speculative decoding: the model's first K decoder layers + final norm "
        "+ LM head, same pipeline and KV layout, into OUTPUT/draft-layers-K (repeatable)",
    )
    add_pipeline_options(comp)
    comp.set_defaults(run=_compile)


def parse_dims(text: str) -> dict[str, int]:
    """Named sizes: NAME=SIZE, comma-separated (batch=1,tokens=16)."""
    dims = {}
    for part in text.split(","):
        name, _, size = part.partition("=")
        if not name.strip() or not size.strip().isdigit():
            raise argparse.ArgumentTypeError(f"expected NAME=SIZE,... like batch=1,tokens=16, got {text!r}")
        dims[name.strip()] = int(size)
    return dims


def _compile(args: argparse.Namespace) -> int:
    """Compile MODEL into the --output artifact and say what was written and how to run it."""
    from ..api import compile_artifact
    from ..runtime.artifact import read_manifest
    from ..runtime.executors.mlir import runs_here

    if args.target != "cpu" and args.recipe is None:
        args.default_recipe = None  # recipes are measured on CPUs
    choice = apply_recipe(args)
    args.backend = args.backend or "onnx"
    started = time.perf_counter()
    out = compile_artifact(
        args.model,
        args.output,
        pass_pipeline(args),
        backend=args.backend,
        target=args.target,
        dtype=args.dtype,
        accuracy_level=args.accuracy_level,
        cuda_arch=args.cuda_arch,
        cpu=args.cpu,
        vm_exec=args.vm_exec,
        dialect=args.dialect,
        static_dims=args.static_dims,
        block_size=args.block_size,
        verify=args.verify,
        draft_layers=args.draft_layers,
        kv_cache_dtype=args.kv_cache_dtype,
        recipe=choice.to_dict() if choice is not None else None,
    )
    manifest = read_manifest(out, verify=False)
    print(compile_time(manifest, time.perf_counter() - started), file=sys.stderr, flush=True)
    size = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    console = Console()
    console.print(f"[bold]{out}[/bold]: {size / 2**20:.1f} MiB, {manifest['backend']} / {manifest['target']}")
    console.print("pipeline: " + ", ".join(step["name"] for step in manifest["pipeline"]), highlight=False)
    for entry in manifest.get("drafts", {}).values():
        draft = out / entry["path"]
        draft_size = sum(p.stat().st_size for p in draft.iterdir() if p.is_file())
        layers = f"{entry['layers']} of {manifest['spec']['num_layers']} decoder layers"
        console.print(f"self-draft: {draft} ({layers}, {draft_size / 2**20:.1f} MiB)", highlight=False)
    if manifest["backend"] == "mlir" and not runs_here(manifest):
        step = manifest["entry_points"]["step"]
        console.print(f"{step['file']}: function @{step['function']} for an MLIR compiler", highlight=False)
    else:
        console.print(f'run it:   llmlower generate {out} --prompt "Hello"', highlight=False)
    return 0
