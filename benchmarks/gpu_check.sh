#!/usr/bin/env bash
# GPU check of the TVM cuda artifact, for a machine with an NVIDIA GPU (one prepared run):
#   1. builds the SmolLM2 q4g32 artifacts if absent: cuda (float16, --cuda-arch, default sm_90) and cpu (float32);
#   2. greedy 32 tokens of 3 chat prompts on both: prints the tokens that agree (float16 vs float32 may part
#      late on near-ties; the first 8 tokens must agree, else the script fails);
#   3. decode tokens/s of the cuda artifact at batch 1 and 16 (128 steps after a 64-token prompt, median of 3).
# Needs llmlower installed with its tvm extra (and the compiler extras to build), nvidia-smi and nvcc.
#   benchmarks/gpu_check.sh [ARTIFACT_DIR] [CUDA_ARCH]
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-artifacts/gpu-check}
ARCH=${2:-sm_90}
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && PY=${PYTHON:-.venv/bin/python}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
if [ ! -f "$DIR/cuda/manifest.json" ]; then
  $PY -m llmlower.cli compile example -o "$DIR/cuda" --backend tvm --target cuda --cuda-arch "$ARCH" --quant q4g32
fi
if [ ! -f "$DIR/cpu/manifest.json" ]; then
  $PY -m llmlower.cli compile example -o "$DIR/cpu" --backend tvm --target cpu --quant q4g32
fi
PYTHONUNBUFFERED=1 $PY - "$DIR" <<'PYEOF'
import statistics, sys, time
from llmlower.runtime import Engine, SamplingParams, StepBatch, sequential_block_tables

directory = sys.argv[1]
prompts = ["What is the capital of France?", "Write a haiku about compilers.", "List three prime numbers."]
greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
cuda = Engine.load(f"{directory}/cuda", max_num_seqs=16, max_context=256)
cpu = Engine.load(f"{directory}/cpu", max_num_seqs=3, max_context=256)
failed = False
for prompt, on_gpu, on_cpu in zip(prompts, cuda.generate(prompts, greedy), cpu.generate(prompts, greedy)):
    agree = next((i for i, (a, b) in enumerate(zip(on_gpu.token_ids, on_cpu.token_ids)) if a != b), 32)
    failed |= agree < 8
    print(f"{prompt!r}: {agree}/32 greedy tokens agree; cuda says {on_gpu.text[:60]!r}")
executor = cuda.executor
for batch in (1, 16):
    speeds = []
    for _ in range(3):
        tables = sequential_block_tables(executor, [64 + 128] * batch)
        executor.step(StepBatch([list(range(100, 164))] * batch, [0] * batch, tables))
        started = time.perf_counter()
        for step in range(128):
            executor.step(StepBatch([[5]] * batch, [64 + step] * batch, tables))
        speeds.append(batch * 128 / (time.perf_counter() - started))
    print(f"decode batch {batch}: {statistics.median(speeds):.1f} tokens/s ({statistics.median(speeds) / batch:.1f} per sequence)")
sys.exit(1 if failed else 0)
PYEOF
