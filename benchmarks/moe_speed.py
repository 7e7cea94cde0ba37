"""Mixture-of-experts speed: a Qwen3-MoE-shaped checkpoint with made-up weights (default 16 layers, hidden 1024,
32 experts of 1024, top-4: 1.75 B parameters, ~0.3 B active per token; SmolLM2's tokenizer), compiled by llmlower
and given to llama.cpp (its own converter, then Q4_0) on the same weights, measured in one run.

Rows: batch-1 decode tokens/s and TTFT of a 512-token prompt (speed.py's loop), 16 requests of ~100 prompt tokens
and 128 new tokens each, all at once (vLLM's offline workload: output tokens / wall time); the bytes a decoded token
reads (llmlower: the roofline cost model, which counts the chosen experts only; llama.cpp: the GGUF's tensors scaled
by the active share) and the dense model of the same active size for comparison.

    .venv/bin/python benchmarks/moe_speed.py [--workdir DIR] [--layers 16] [--hidden 1024] [--experts 32]
        [--expert-size 1024] [--top-k 4] [--quant q4g32] [--lm-head-bits 4] [--backends onnx,tvm] [--llamacpp]
        [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers
from artifacts import ensure_artifact
from speed import PROMPT_TOKENS, bandwidth_roof, llmlower_executor, measure, peer

from llmlower.frontend import capture, example_checkpoint, load
from llmlower.frontend.example import cache_dir
from llmlower.passes import build_pipeline, run_pipeline
from llmlower.roofline import decode_read_bytes, machine_ceilings
from llmlower.runtime import Engine, SamplingParams

PEERS = Path(__file__).parent / "peers"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
OFFLINE_REQUESTS, OFFLINE_PROMPT, OFFLINE_NEW = 16, 100, 128


def moe_config(args: argparse.Namespace, vocab: int) -> transformers.Qwen3MoeConfig:
    """Qwen3-MoE's shape scaled to this machine: 16 heads of 64, 4 kv heads, every layer sparse."""
    return transformers.Qwen3MoeConfig(
        vocab_size=vocab,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(1, args.hidden // 256),
        head_dim=64,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        moe_intermediate_size=args.expert_size,
        intermediate_size=args.expert_size,
        max_position_embeddings=4096,
        norm_topk_prob=True,
        tie_word_embeddings=False,
        initializer_range=0.02,
    )


def write_checkpoint(directory: Path, args: argparse.Namespace) -> Path:
    """The made-up checkpoint (bf16 safetensors, seeded) with SmolLM2's tokenizer files; written once."""
    if (directory / "config.json").is_file():
        return directory
    smollm2 = example_checkpoint()
    vocab = json.loads((smollm2 / "config.json").read_text())["vocab_size"]
    torch.manual_seed(0)
    print(f"[moe] writing a made-up checkpoint into {directory}", file=sys.stderr)
    model = transformers.AutoModelForCausalLM.from_config(moe_config(args, vocab), dtype=torch.bfloat16)
    staging = directory.with_name(directory.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging, safe_serialization=True)
    for name in TOKENIZER_FILES:
        shutil.copy(smollm2 / name, staging / name)
    staging.rename(directory)
    return directory


def offline_throughput(engine: Engine, prompts: list[list[int]]) -> float:
    """Output tokens/s of every prompt submitted at once, OFFLINE_NEW greedy tokens each (EOS ignored)."""
    params = SamplingParams(temperature=0, max_tokens=OFFLINE_NEW, ignore_eos=True)
    engine.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))  # warm-up
    started = time.perf_counter()
    results = engine.generate(prompts, params)
    return sum(len(r.token_ids) for r in results) / (time.perf_counter() - started)


def llamacpp_gguf(checkpoint: Path, directory: Path, kind: str) -> Path:
    """The checkpoint converted to GGUF by llama.cpp's own convert_hf_to_gguf.py (setup.sh llamacpp-converter; run
    with this venv's torch) and quantized to `kind` (e.g. Q4_0) by llama.cpp's quantizer; made once."""
    target = directory / f"moe.{kind}.gguf"
    if target.is_file():
        return target
    source = PEERS / ".llama.cpp"
    f16 = directory / "moe.f16.gguf"
    if not f16.is_file():
        environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(source), str(source / "gguf-py")])}
        convert = (  # the checkpoint carries SmolLM2's tokenizer, which the converter knows as "smollm" by the hash
            "import runpy, sys\n"  # of the original's files; this copy's differs, so the name is given
            "from conversion import base\n"
            "base.TextModel.get_vocab_base_pre = lambda self, tokenizer: 'smollm'\n"
            "sys.argv = sys.argv[1:]\n"
            "runpy.run_path(sys.argv[0], run_name='__main__')"
        )
        command = [sys.executable, "-c", convert, str(source / "convert_hf_to_gguf.py"), str(checkpoint)]
        subprocess.run([*command, "--outtype", "f16", "--outfile", str(f16)], check=True, env=environment)
    quantize = (
        "import sys, llama_cpp\n"
        "params = llama_cpp.llama_model_quantize_default_params()\n"
        f"params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_{kind}\n"
        "sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), params))"
    )
    python = PEERS / ".venv-llamacpp" / "bin" / "python"
    subprocess.run([str(python), "-c", quantize, str(f16), str(target)], check=True)
    return target


def read_bytes(checkpoint: Path, quant: dict, context: int) -> int:
    """Bytes a decoded token reads at `context` (the roofline cost model on the checkpoint's program after the
    pipeline of the `quant` options: the chosen experts only)."""
    return decode_read_bytes(run_pipeline(capture(load(checkpoint)), build_pipeline(**quant)), context)


def dense_read_bytes(args: argparse.Namespace, vocab: int, quant: dict, context: int) -> int:
    """read_bytes of the dense model of the same active size: an MLP of top_k x expert_size in place of the
    experts (random weights: only shapes matter)."""
    config = moe_config(args, vocab)
    dense = transformers.Qwen3Config(**{**config.to_dict(), "intermediate_size": args.top_k * args.expert_size})
    with tempfile.TemporaryDirectory() as root:
        transformers.AutoModelForCausalLM.from_config(dense).save_pretrained(root, safe_serialization=True)
        for name in TOKENIZER_FILES:
            shutil.copy(example_checkpoint() / name, Path(root) / name)
        return read_bytes(Path(root), quant, context)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=cache_dir() / "bench" / "moe")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--expert-size", type=int, default=1024)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--quant", default="q4g32", help="llmlower's quant pipeline (build_pipeline's quant)")
    parser.add_argument("--lm-head-bits", type=int, choices=[4, 8], help="the LM head's bits under --quant")
    parser.add_argument("--backends", default="onnx,tvm")
    parser.add_argument("--llamacpp", default="Q4_0", help="llama.cpp's quant type (Q4_0, Q4_K_M, ...), or 'none'")
    parser.add_argument("--vllm", action="store_true", help="also run vLLM's CPU build (setup.sh vllm)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    shape = f"L{args.layers}-H{args.hidden}-E{args.experts}x{args.expert_size}-k{args.top_k}"
    workdir = args.workdir / shape
    checkpoint = write_checkpoint(workdir / "checkpoint", args)
    ceilings = machine_ceilings("cpu")
    filler = list(range(1000, 1000 + max(PROMPT_TOKENS)))
    prompts = {n: filler[:n] for n in PROMPT_TOKENS}
    offline = [[2000 + 37 * i + j for j in range(OFFLINE_PROMPT)] for i in range(OFFLINE_REQUESTS)]
    context = max(PROMPT_TOKENS) + args.new_tokens + 1
    read_context = PROMPT_TOKENS[0] + args.new_tokens // 2
    quant = {"quant": args.quant, **({"lm_head_bits": args.lm_head_bits} if args.lm_head_bits else {})}
    label = args.quant + (f" lm-head-{args.lm_head_bits}" if args.lm_head_bits else "")
    directories = {backend: workdir / f"{backend}-{label.replace(' ', '-')}" for backend in args.backends.split(",")}
    for backend, directory in directories.items():  # first, alone in memory: compiling holds the model in float32
        ensure_artifact(str(checkpoint), backend, quant, directory)  # more than once
    moe_bytes = read_bytes(checkpoint, quant, read_context)
    vocab = json.loads((checkpoint / "config.json").read_text())["vocab_size"]
    dense_bytes = dense_read_bytes(args, vocab, quant, read_context)
    rows: dict[str, dict] = {}
    for backend, directory in directories.items():
        name = f"llmlower {backend} {label}"
        engine = Engine.load(directory, max_num_seqs=1, max_context=context, threads=args.threads)
        print(f"[moe] {name}: batch 1", file=sys.stderr)
        row = measure(*llmlower_executor(engine.executor), prompts, args.new_tokens, args.repeats)
        row.update(bandwidth_roof(row["decode_tokens_per_s"], moe_bytes, ceilings.bandwidth))
        del engine
        many = Engine.load(directory, max_num_seqs=OFFLINE_REQUESTS, max_context=256, threads=args.threads)
        print(f"[moe] {name}: {OFFLINE_REQUESTS} requests", file=sys.stderr)
        row["offline_16_tokens_per_s"] = statistics.median(
            offline_throughput(many, offline) for _ in range(args.repeats)
        )
        rows[name] = row
    if args.llamacpp != "none":
        gguf = llamacpp_gguf(checkpoint, workdir, args.llamacpp)
        print(f"[moe] llama.cpp {args.llamacpp}: batch 1", file=sys.stderr)
        rows[f"llama.cpp {args.llamacpp}"] = peer(
            "llamacpp", gguf, prompts, args.new_tokens, args.repeats, args.threads
        )
    if args.vllm:
        print("[moe] vLLM CPU bf16", file=sys.stderr)
        rows["vLLM CPU bf16"] = peer(
            "vllm_offline", checkpoint, prompts, args.new_tokens, args.repeats, args.threads, venv="vllm"
        )
    report = {
        "shape": shape,
        "machine": ceilings.description,
        "bandwidth_bytes_per_s": ceilings.bandwidth,
        "decode_bytes_per_token": {"moe": moe_bytes, "dense of the same active size": dense_bytes},
        "rows": rows,
    }
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
