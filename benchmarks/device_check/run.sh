#!/usr/bin/env bash
# The GPU check, on the lent GPU machine: one H200, bare (python3 3.12 with torch, transformers, onnx,
# onnxruntime, tokenizers, safetensors, numpy, jinja2; no TVM, no registry), at most 64 MiB of files per run.
#
# Here, first (needs the dev install, nvcc and the registry; minutes):
#   .venv/bin/python benchmarks/device_check/prepare.py
# which builds the git-ignored bundle build/device-check/bundle/ (trimmed TVM runtime, CUDA artifacts without
# weights, the tiny Llama with weights, plan.json) and checks the tree + bundle against 60 MiB. Then the run
# tool's call, from the repository root:
#   run(command="bash benchmarks/device_check/run.sh", carry=["build/device-check/bundle"], timeout_s=540)
# Installs nothing: llmlower is this tree's src/ and TVM's runtime the bundle's site/ (both on PYTHONPATH).
# Each phase is its own process under a time limit, so a hang or a crash costs only that phase; all of them
# together stay under 8 minutes. Progress and results are printed and written to $OUT: device-check.txt (what
# was printed) and device-check.json (every phase's result, gathered by summary from phases/*.json, which are
# then removed: the run tool brings back at most 8 files).
#
# On a machine without a GPU it runs too (env reports no CUDA device; agree and speed fail by name), which is
# how its CPU parts are checked here: BUNDLE=... OUT=... bash benchmarks/device_check/run.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
BUNDLE=${BUNDLE:-build/device-check/bundle}
OUT=${OUT:-$(mktemp -d)}
PY=${PYTHON:-python3}
if [ ! -f "$BUNDLE/plan.json" ]; then
  echo "no $BUNDLE/plan.json: build the bundle with benchmarks/device_check/prepare.py and carry it" >&2
  exit 2
fi
BUNDLE=$(cd "$BUNDLE" && pwd)
mkdir -p "$OUT"
# TVM_FFI_DISABLE_TORCH_C_DLPACK: tvm_ffi would otherwise JIT-compile a torch extension when torch is present
export PYTHONPATH="$PWD/src:$BUNDLE/site${PYTHONPATH:+:$PYTHONPATH}" TVM_FFI_DISABLE_TORCH_C_DLPACK=1 PYTHONUNBUFFERED=1

phase() {  # phase SECONDS ARGS...: one check.py phase, killed after SECONDS
  local limit=$1
  shift
  timeout -k 5 "$limit" "$PY" benchmarks/device_check/check.py --bundle "$BUNDLE" --out "$OUT" "$@" 2>&1 |
    tee -a "$OUT/device-check.txt"
  local status=${PIPESTATUS[0]}
  [ "$status" = 124 ] && echo "== $* timed out after ${limit}s ==" | tee -a "$OUT/device-check.txt"
  return 0
}

started=$SECONDS
phase 45 env
phase 90 agree
builds() {  # the plan's builds for a phase
  "$PY" -c 'import json, sys; print(" ".join(json.load(open(sys.argv[1])).get(sys.argv[2], [])))' "$BUNDLE/plan.json" "$1"
}
for name in $(builds speed); do
  phase 75 speed "$name"
done
for name in $(builds kernels); do
  phase 45 kernels "$name"
done
phase 20 summary
[ -f "$OUT/device-check.json" ] && rm -rf "$OUT/phases"
echo "device check: $((SECONDS - started))s; report in $OUT" | tee -a "$OUT/device-check.txt"
