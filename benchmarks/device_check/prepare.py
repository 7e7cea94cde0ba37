"""Build, here, everything the GPU check (run.sh) needs on the lent GPU machine besides the repository tree: one
git-ignored folder, build/device-check/bundle/, that the run carries. That machine is bare (python3 3.12 with
torch, transformers, onnx, onnxruntime, tokenizers, safetensors, numpy, jinja2; no TVM, no registry) and a run
takes at most 64 MiB of files, so the folder holds

- site/: TVM's runtime trimmed to what the executor uses, with tvm_ffi's core for Python 3.12 (runtime_site.py);
- models/: TVM cuda artifacts (--cuda-arch, default sm_90; fp16, model.so + model.fatbin) of SmolLM2-135M
  (q4g32) and of a Llama-3.2-1B-shaped model (q4g32, random; its VM as bytecode and compiled), and ONNX Runtime's
  CUDA artifact of SmolLM2 (q4g32), all without their weights files (run with weights="random"); the tests' tiny
  Llama as a checkpoint and compiled for cuda and cpu, TVM and ONNX, with its weights, for greedy agreement;
- plan.json: what to run, and for each speed run the bytes a decode step moves at batch 1, 16 and 64 (the
  roofline cost model on the compiled Program), for its share of the HBM roof.

Artifacts are compiled into build/device-check/ (kept, with their weights; reused while their recipe, the
compiler's source digest included, is the same) and copied into the bundle. The bundle plus the tree must stay
within carried.BUDGET, checked at the end.

    .venv/bin/python benchmarks/device_check/prepare.py [--cuda-arch sm_90] [--only NAME,...]
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from carried import BUDGET, carried_size
from runtime_site import build_site

from llmlower.api import compile_artifact, compile_program
from llmlower.compile_cache import compiler_source_digest
from llmlower.passes import build_pipeline
from llmlower.roofline.cost import step_cost
from llmlower.roofline.shapes import decode_step
from llmlower.runtime.artifact import FORMAT_VERSION, read_manifest
from llmlower.testing import CHATML, build_tokenizer, write_tiny_checkpoint

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
WORK = REPO / "build" / "device-check"  # git-ignored (and skipped by ruff): checkpoints, artifacts, wheels
BUNDLE = WORK.relative_to(REPO) / "bundle"  # relative to the repository root: the run's carry path
DEVICE_PYTHON = "cp312"
PROMPT, STEPS = 64, 64  # a speed run prefills PROMPT tokens per sequence, then times STEPS decode steps
BATCHES = (1, 16, 64)
HBM_BYTES_PER_S = 4.3e12  # H200: 4.8 TB/s peak HBM3e, about 4.3 TB/s reachable
TINY, LLAMA_1B = "tiny-llama", "llama-1b"
# Llama-3.2-1B's shape (hidden 2048, 16 layers, 32 heads of 64, 8 kv heads, vocab 128256, tied embeddings) with
# 2,048 positions (rotary tables sized to what a check uses) and random weights: no hub here.
LLAMA_1B_CONFIG = dict(
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    max_position_embeddings=2048,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=4,
)


@dataclass(frozen=True)
class Build:
    """One artifact of the bundle: `model` "example" (SmolLM2-135M), LLAMA_1B or TINY; `carry_weights`: its
    weights file travels (else the device makes them up); `role`: "speed" or "agreement"; `vm_exec`: the tvm
    option, where not the target's default."""

    name: str
    model: str
    backend: str
    target: str
    quant: str
    carry_weights: bool
    role: str
    vm_exec: str | None = None


BUILDS = (
    Build("tiny-tvm-cpu", TINY, "tvm", "cpu", "none", True, "agreement"),  # first: the runtime trace runs it
    Build("tiny-tvm-cuda", TINY, "tvm", "cuda", "none", True, "agreement"),
    Build("tiny-onnx-cpu", TINY, "onnx", "cpu", "none", True, "agreement"),
    Build("tiny-onnx-cuda", TINY, "onnx", "cuda", "none", True, "agreement"),
    Build("smollm2-q4g32-tvm-cuda", "example", "tvm", "cuda", "q4g32", False, "speed"),
    Build("smollm2-q4g32-onnx-cuda", "example", "onnx", "cuda", "q4g32", False, "speed"),
    Build("llama-1b-q4g32-tvm-cuda", LLAMA_1B, "tvm", "cuda", "q4g32", False, "speed"),
    # the step's ~250 kernel launches from compiled VM code instead of the bytecode interpreter (the cuda default)
    Build("llama-1b-q4g32-tvm-cuda-compiled", LLAMA_1B, "tvm", "cuda", "q4g32", False, "speed", "compiled"),
)
AGREEMENT_PAIRS = (("tiny-tvm-cuda", "tiny-tvm-cpu"), ("tiny-onnx-cuda", "tiny-onnx-cpu"))


def checkpoint(model: str) -> str | Path:
    """The checkpoint a build compiles: the example, or a random one written into WORK once."""
    if model == "example":
        return model
    directory = WORK / "checkpoints" / model
    if (directory / "config.json").is_file():
        return directory
    staging = directory.with_name(f".{model}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    if model == TINY:
        write_tiny_checkpoint("llama", staging)
    else:
        write_random_llama(staging)
    staging.rename(directory)
    return directory


def write_random_llama(directory: Path) -> None:
    """LLAMA_1B_CONFIG with random float16 weights, and the tests' tiny tokenizer (its ids are all < vocab)."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**LLAMA_1B_CONFIG)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float16)
    model.save_pretrained(directory, safe_serialization=True)
    build_tokenizer().save(str(directory / "tokenizer.json"))
    tokens = {"bos_token": "<s>", "eos_token": "<|im_end|>", "unk_token": "<unk>", "chat_template": CHATML}
    (directory / "tokenizer_config.json").write_text(json.dumps(tokens))


@functools.cache
def decode_costs(model: str, quant: str) -> dict[str, dict[str, int]]:
    """Bytes a decode step of `model` under `quant` moves at each batch size, at the mean context of a speed run's timed
    steps: the roofline cost model on its pipeline without paged_attention (as the roofline study costs an
    artifact: the paged layout moves the same bytes, addressed by blocks), float16 as compiled for cuda."""
    _, program = compile_program(checkpoint(model), build_pipeline(None, quant), dtype="float16")
    context = PROMPT + STEPS // 2
    costs = {}
    for batch in BATCHES:
        total = step_cost(program, decode_step(batch, context)).total
        costs[str(batch)] = {
            "bytes": total.bytes,
            "weight_bytes": total.weight_bytes,
            "kv_read_bytes": total.kv_read_bytes,
            "context": context,
        }
    return costs


def compile_build(build: Build, cuda_arch: str) -> dict:
    """Compile `build` into WORK/artifacts (unless its recipe is unchanged) and return its record: the recipe,
    and the decode costs of speed runs."""
    output = WORK / "artifacts" / build.name
    recipe_file = output.with_name(f"{build.name}.json")
    recipe = {
        **asdict(build),
        "cuda_arch": cuda_arch,
        "format_version": FORMAT_VERSION,
        "compiler_source": compiler_source_digest(),  # a changed kernel or schedule compiles again
    }
    if recipe_file.is_file() and (output / "manifest.json").is_file():
        record = json.loads(recipe_file.read_text())
        if record["recipe"] == recipe:
            return record
    record: dict = {"recipe": recipe}
    options = {"cuda_arch": cuda_arch} if (build.backend, build.target) == ("tvm", "cuda") else {}
    if (build.backend, build.target) == ("tvm", "cpu"):
        options["cpu"] = "x86-64-v3"  # the GPU machine's CPU is not this one: AVX2-era x86 at least
    if build.vm_exec:
        options["vm_exec"] = build.vm_exec
    started = time.perf_counter()
    compile_artifact(
        checkpoint(build.model),
        output,
        build_pipeline(None, build.quant),
        backend=build.backend,
        target=build.target,
        **options,
    )
    record["compile_s"] = round(time.perf_counter() - started, 1)
    gc.collect()
    if build.role == "speed":
        record["costs"] = decode_costs(build.model, build.quant)
    recipe_file.write_text(json.dumps(record, indent=1))
    gc.collect()
    return record


def copy_artifact(source: Path, destination: Path, carry_weights: bool) -> None:
    """Copy an artifact, leaving out its weights file unless it travels."""
    weights = read_manifest(source, verify=False)["weights"]["file"]
    shutil.copytree(source, destination, ignore=None if carry_weights else shutil.ignore_patterns(weights))


def prepare(bundle: Path, cuda_arch: str, only: set[str] | None = None) -> dict:
    """Build the bundle at `bundle` (replaced): the builds (all, or those named in `only`), the trimmed TVM
    runtime and plan.json; refuses to finish over the size budget."""
    builds = [b for b in BUILDS if only is None or b.name in only]
    records = {}
    for build in builds:
        print(f"[prepare] {build.name}", flush=True)
        records[build.name] = compile_build(build, cuda_arch)
    shutil.rmtree(bundle, ignore_errors=True)
    (bundle / "models").mkdir(parents=True)
    tiny_cpu = WORK / "artifacts" / BUILDS[0].name
    if BUILDS[0] not in builds:
        compile_build(BUILDS[0], cuda_arch)
    print("[prepare] trimmed TVM runtime (site/)", flush=True)
    trace = build_site(bundle / "site", tiny_cpu, tags=(DEVICE_PYTHON,), cache=WORK / "wheels")
    for build in builds:
        copy_artifact(WORK / "artifacts" / build.name, bundle / "models" / build.name, build.carry_weights)
    if any(b.model == TINY for b in builds):
        shutil.copytree(checkpoint(TINY), bundle / "models" / TINY)
    plan = {
        "prompt": PROMPT,
        "steps": STEPS,
        "batches": list(BATCHES),
        "hbm_bytes_per_s": HBM_BYTES_PER_S,
        "cuda_arch": cuda_arch,
        "builds": records,
        "speed": [b.name for b in builds if b.role == "speed"],
        "kernels": [b.name for b in builds if b.role == "speed" and b.model == LLAMA_1B],  # where a step's time goes
        "agreement": {
            "checkpoint": f"models/{TINY}",
            "pairs": [list(p) for p in AGREEMENT_PAIRS if all(n in records for n in p)],
        },
        "runtime_modules": len(trace["files"]),
    }
    (bundle / "plan.json").write_text(json.dumps(plan, indent=1))
    size = carried_size(REPO, [bundle.relative_to(REPO)])
    print(f"[prepare] carried: {size.describe()}", flush=True)
    if size.total > BUDGET:
        raise SystemExit(f"the tree and {bundle} come to {size.describe()}: over the budget")
    return plan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cuda-arch", default="sm_90", help="GPU architecture of the cuda builds (H200: sm_90)")
    parser.add_argument("--only", help=f"comma-separated builds (default all: {', '.join(b.name for b in BUILDS)})")
    args = parser.parse_args()
    only = set(args.only.split(",")) if args.only else None
    unknown = (only or set()) - {b.name for b in BUILDS}
    if unknown:
        parser.error(f"--only: unknown builds {', '.join(sorted(unknown))}")
    prepare(REPO / BUNDLE, args.cuda_arch, only)


if __name__ == "__main__":
    main()
