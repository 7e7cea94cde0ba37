#!/usr/bin/env bash
# The GPU check, on a machine with the dev install (.venv), nvcc and an NVIDIA GPU: build the bundle, then run
# it, as the lent GPU machine does (benchmarks/device_check/run.sh says how to run it there, where only the
# bundle travels). Prints the environment, greedy agreement of CUDA and CPU artifacts, and decode tokens/s at
# batch 1, 16 and 64 with each step's share of the HBM roof.
#   benchmarks/gpu_check.sh [CUDA_ARCH]   (default sm_90)
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/python benchmarks/device_check/prepare.py --cuda-arch "${1:-sm_90}"
PYTHON=.venv/bin/python bash benchmarks/device_check/run.sh
