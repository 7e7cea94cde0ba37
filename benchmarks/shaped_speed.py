"""Speed at the sizes people deploy: a checkpoint of a named shape with made-up weights, compiled by llmlower and
given, the same file, to the peer engines, measured in one run. Quality is not the question here: the weights are
random (seeded), the tokenizer SmolLM2's.

Shapes: `llama-1b` (Llama-3.2-1B's: 16 layers, hidden 2048, 32 heads of 64 with 8 kv heads, MLP 8192, tied
embeddings; 1.07 B parameters with this vocabulary), `qwen3-moe` (Qwen3-MoE's scaled to this machine: 16 layers,
hidden 1024, 32 experts of 1024, top-4; 1.75 B parameters, 0.30 B active), `qwen3.5-hybrid` (Qwen3.5's pattern of
three Gated DeltaNet layers to one attention layer, 24 layers of hidden 1024; a recurrent state per sequence beside
a KV cache in a quarter of the layers) and `smollm2` (the example model's configuration, 135 M parameters).

Rows: batch-1 decode tokens/s (64 greedy tokens after a 13-token prompt, and after the longest prompt: its context's
KV reads), TTFT of 512- and 2,048-token prompts (--prompt-tokens; speed.py's loop), 16 requests of 100 prompt tokens
and 128 new tokens each, all at once (vLLM's offline workload: output tokens / wall time; prefix caching off, so
each repeat prefills again; llmlower's step budget a batch job's, --offline-budget, as vLLM's LLM class takes 4096
tokens a step on a CPU by default); for each engine the bytes a decoded token reads and the share of the machine's
measured bandwidth its decode reaches. Peers, set up by benchmarks/peers/setup.sh: llama.cpp (its own converter,
then its quantizer: --llamacpp Q4_0,Q4_K_M; the 16 requests as parallel sequences of one context, as its server's
slots decode them), ONNX Runtime GenAI's builder (its CPU int4 defaults: --genai) and
vLLM's CPU build (--vllm: bf16 where the CPU computes it, else float32; --vllm-without-amx: the same kept off AMX
tiles, as on a CPU without them). Bytes a token reads: llmlower from the
roofline cost model on the artifact's own pipeline (the chosen experts only), peers from their model files (dense
shapes only: their files hold every expert).

    .venv/bin/python benchmarks/shaped_speed.py [--shape llama-1b] [--quants q4mix,q4g32-sym] [--lm-head-bits 4]
        [--scale-dtypes auto,float16] [--kv-cache-dtypes auto,float16] [--backends onnx] [--llamacpp Q4_0] [--genai]
        [--vllm] [--vllm-without-amx] [--new-tokens 64] [--prompt-tokens 13,512,2048] [--offline-budget 2048]
        [--repeats 3] [--threads N] [--json FILE]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import transformers
from artifacts import ensure_artifact
from peers.runner import OFFLINE, OFFLINE_NEW, OFFLINE_REQUESTS, offline_prompts, without_amx_environment
from speed import (
    artifact_read_bytes,
    bandwidth_roof,
    llamacpp_read_bytes,
    llmlower_executor,
    measure,
    ortgenai_read_bytes,
    peer,
)

from llmlower.frontend import capture, example_checkpoint, load
from llmlower.frontend.example import cache_dir
from llmlower.passes import build_pipeline, run_pipeline
from llmlower.recipes import RECIPES
from llmlower.roofline import Ceilings, decode_read_bytes, machine_ceilings
from llmlower.runtime import Engine, SamplingParams
from llmlower.runtime.cpu_features import host_cpu_flags

PEERS = Path(__file__).parent / "peers"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
PROMPT_TOKENS = "13,512,2048"  # the first is the decode's prompt; decode is also timed after the last
MTP_FAMILIES = {"qwen3_5_text", "qwen3_next"}  # llama.cpp's converter looks for their multi-token-prediction layers
OFFLINE_BUDGET = 2048  # tokens a step for the 16 requests: every prompt in one step, as vLLM's offline engine runs
SCALES = {  # --scale-dtypes value -> (build_pipeline options, row name suffix, directory suffix)
    "auto": ({}, "", ""),
    "float16": ({"scale_dtype": "float16"}, " f16 scales", "-f16"),
}
KV_CACHES = {  # --kv-cache-dtypes value -> (row name suffix, directory suffix)
    "auto": ("", ""),
    "float16": (" f16 KV", "-kv-f16"),
    "int8": (" int8 KV", "-kv-int8"),
}
ISA_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_int8", "asimddp", "i8mm", "sve")


def llama_1b(vocab: int) -> transformers.PretrainedConfig:
    """Llama-3.2-1B's shape."""
    return transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=2048,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        intermediate_size=8192,
        max_position_embeddings=4096,
        rope_theta=500000.0,
        tie_word_embeddings=True,
        initializer_range=0.02,
    )


def qwen3_moe(vocab: int) -> transformers.PretrainedConfig:
    """Qwen3-MoE's shape scaled to this machine: 16 heads of 64, 4 kv heads, every layer sparse."""
    return transformers.Qwen3MoeConfig(
        vocab_size=vocab,
        hidden_size=1024,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=64,
        num_experts=32,
        num_experts_per_tok=4,
        moe_intermediate_size=1024,
        intermediate_size=1024,
        max_position_embeddings=4096,
        norm_topk_prob=True,
        tie_word_embeddings=False,
        initializer_range=0.02,
    )


def qwen3_5_hybrid(vocab: int) -> transformers.PretrainedConfig:
    """Qwen3.5's layer pattern scaled to this machine: 24 layers of hidden 1024, three Gated DeltaNet layers (16
    heads of 128) to each full-attention layer (8 heads of 256, 2 kv heads), MLP 3,584, tied embeddings."""
    return transformers.Qwen3_5TextConfig(
        vocab_size=vocab,
        hidden_size=1024,
        num_hidden_layers=24,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=256,
        intermediate_size=3584,
        linear_num_key_heads=16,
        linear_num_value_heads=16,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 6,
        max_position_embeddings=16384,
        tie_word_embeddings=True,
        initializer_range=0.02,
    )


def smollm2(vocab: int) -> transformers.PretrainedConfig:
    """SmolLM2-135M's own configuration (the example model's), for its figures beside peers that need a checkpoint
    they can read (vLLM)."""
    config = transformers.AutoConfig.from_pretrained(example_checkpoint(), vocab_size=vocab)
    config.max_position_embeddings = 16384  # room to decode after an 8,192-token prompt (RoPE's theta unchanged)
    return config


SHAPES: dict[str, Callable[[int], transformers.PretrainedConfig]] = {
    "llama-1b": llama_1b,
    "qwen3-moe": qwen3_moe,
    "qwen3.5-hybrid": qwen3_5_hybrid,
    "smollm2": smollm2,
}


def write_checkpoint(directory: Path, config: transformers.PretrainedConfig) -> Path:
    """The made-up checkpoint (bf16 safetensors, seeded) with SmolLM2's tokenizer files; written once."""
    if (directory / "config.json").is_file():
        return directory
    torch.manual_seed(0)
    print(f"[shaped] writing a made-up checkpoint into {directory}", file=sys.stderr)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    staging = directory.with_name(directory.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging, safe_serialization=True)
    for name in TOKENIZER_FILES:
        shutil.copy(example_checkpoint() / name, staging / name)
    staging.rename(directory)
    return directory


def dense_equivalent_read_bytes(config: transformers.PretrainedConfig, quant: dict, context: int) -> int | None:
    """For a mixture of experts: the bytes a token of the dense model of the same active size reads (an MLP of
    top_k x expert size in place of the experts; random weights, only shapes matter). None for a dense shape."""
    if not getattr(config, "num_experts", None):
        return None
    active = config.num_experts_per_tok * config.moe_intermediate_size
    dense = transformers.Qwen3Config(**{**config.to_dict(), "intermediate_size": active})
    with tempfile.TemporaryDirectory() as root:
        transformers.AutoModelForCausalLM.from_config(dense).save_pretrained(root, safe_serialization=True)
        for name in TOKENIZER_FILES:
            shutil.copy(example_checkpoint() / name, Path(root) / name)
        return decode_read_bytes(run_pipeline(capture(load(Path(root))), build_pipeline(**quant)), context)


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
    target = directory / f"model.{kind}.gguf"
    if target.is_file():
        return target
    source = PEERS / ".llama.cpp"
    f16 = directory / "model.f16.gguf"
    if not f16.is_file():
        environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(source), str(source / "gguf-py")])}
        convert = (  # the checkpoint carries SmolLM2's tokenizer, which the converter knows as "smollm" by the hash
            "import runpy, sys\n"  # of the original's files; this copy's differs, so the name is given. It has no
            "from conversion import base\n"  # sentencepiece model, which Llama's converter tries first by importing
            "def no_sentencepiece(self):\n"  # sentencepiece (not installed): say the file is missing, as it would
            "    raise FileNotFoundError('no tokenizer.model')\n"
            "base.TextModel._create_vocab_sentencepiece = no_sentencepiece\n"
            "base.TextModel.get_vocab_base_pre = lambda self, tokenizer: 'smollm'\n"
            "sys.argv = sys.argv[1:]\n"
            "runpy.run_path(sys.argv[0], run_name='__main__')"
        )
        command = [sys.executable, "-c", convert, str(source / "convert_hf_to_gguf.py"), str(checkpoint)]
        config = json.loads((checkpoint / "config.json").read_text())
        if config["model_type"] in MTP_FAMILIES and not config.get("mtp_num_hidden_layers"):
            command.append("--no-mtp")  # the converter otherwise expects multi-token-prediction layers
        subprocess.run(
            [*command, "--outtype", "f16", "--outfile", str(f16)], check=True, env=environment, stdout=sys.stderr
        )
    quantize = (
        "import sys, llama_cpp\n"
        "params = llama_cpp.llama_model_quantize_default_params()\n"
        f"params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_{kind}\n"
        "sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), params))"
    )
    python = PEERS / ".venv-llamacpp" / "bin" / "python"
    subprocess.run([str(python), "-c", quantize, str(f16), str(target)], check=True, stdout=sys.stderr)
    return target


def genai_model(checkpoint: Path, directory: Path) -> Path:
    """The checkpoint built by ONNX Runtime GenAI's own builder with its CPU int4 defaults, as setup.sh builds
    SmolLM2's (symmetric int4, block 32, accuracy level 4); made once."""
    target = directory / "ortgenai-int4"
    if (target / "genai_config.json").is_file():
        return target
    staging = directory / "ortgenai-int4.partial"
    shutil.rmtree(staging, ignore_errors=True)
    python = PEERS / ".venv-ortgenai" / "bin" / "python"
    command = [str(python), "-m", "onnxruntime_genai.models.builder", "-i", str(checkpoint), "-o", str(staging / "out")]
    command += ["-p", "int4", "-e", "cpu", "-c", str(staging / "cache")]
    subprocess.run([*command, "--extra_options", "block_size=32", "accuracy_level=4"], check=True, stdout=sys.stderr)
    (staging / "out").rename(target)
    shutil.rmtree(staging)
    return target


def float_read_bytes(float32_bytes: int, dtype: str) -> int:
    """Bytes per decoded token of the checkpoint run unquantized in `dtype` (vLLM's CPU row), from what the float32
    program reads (decode_read_bytes: weights and KV cache by the roofline cost model, the chosen experts only)."""
    return float32_bytes * (2 if dtype == "bfloat16" else 4) // 4


def machine(ceilings: Ceilings) -> str:
    """The CPU, its vector ISA and the measured bandwidth: what every speed figure is stated with."""
    flags = host_cpu_flags() or set()
    isa = ", ".join(flag for flag in ISA_FLAGS if flag in flags) or "no vector extensions listed"
    return f"{ceilings.description}; {isa}; {ceilings.bandwidth / 1e9:.1f} GB/s measured"


def print_table(rows: dict[str, dict], prompt_tokens: list[int]) -> None:
    """The rows as a Markdown table, decode also as a ratio to the first llama.cpp row and after the longest
    prompt."""
    llamacpp = next((row["decode_tokens_per_s"] for name, row in rows.items() if name.startswith("llama.cpp")), None)
    ttfts = [f"TTFT {n}" for n in prompt_tokens[1:]]
    header = ["engine", "batch-1 decode tok/s", "vs llama.cpp", f"decode at {prompt_tokens[-1]}", *ttfts]
    header += ["16 requests tok/s", "MB/token", "roof"]
    print("| " + " | ".join(header) + " |")
    print("|---" + "|---:" * (len(header) - 1) + "|")
    for name, row in rows.items():
        decode, read = row["decode_tokens_per_s"], row.get("bytes_per_token")
        cells = [
            _cell(decode, "{:.1f}"),
            _cell(decode / llamacpp if llamacpp else None, "{:.2f}x"),
            _cell(row.get("decode_long_tokens_per_s"), "{:.1f}"),
            *(_cell(row.get(f"ttft_{n}_s"), "{:.2f} s") for n in prompt_tokens[1:]),
            _cell(row.get(OFFLINE), "{:.1f}"),
            _cell(read / 1e6 if read else None, "{:.1f}"),
            _cell(row.get("roof_pct"), "{:.0f}%"),
        ]
        print(f"| {name} | " + " | ".join(cells) + " |")


def _cell(value: float | None, form: str) -> str:
    return "-" if value is None else form.format(value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-1b")
    parser.add_argument("--workdir", type=Path, default=cache_dir() / "bench" / "shaped")
    parser.add_argument("--quants", default="q4mix,q4g32-sym", help="llmlower's quant pipelines, comma-separated")
    parser.add_argument("--lm-head-bits", type=int, choices=[4, 8], help="the LM head's bits under each quant")
    parser.add_argument(
        "--scale-dtypes", default="auto", help="the quantized weights' scales under each quant: auto, float16 or both"
    )
    parser.add_argument(
        "--kv-cache-dtypes", default="auto", help="the KV cache's dtypes, comma-separated: auto, float16, int8"
    )
    parser.add_argument("--backends", default="onnx", help="llmlower's backends, comma-separated (onnx, tvm)")
    parser.add_argument(
        "--recipes", default="", help="also llmlower's named recipes (llmlower.recipes), comma-separated: fast, ..."
    )
    parser.add_argument(
        "--tvm-cpus",
        default="",
        help="also build each tvm row for these LLVM CPUs, comma-separated (x86-64-v3: AVX2 only; rocketlake: AVX-512 "
        "VNNI without AMX); their rows are named 'ROW --cpu NAME'",
    )
    parser.add_argument("--llamacpp", default="Q4_0", help="llama.cpp quant types, comma-separated, or 'none'")
    parser.add_argument("--genai", action="store_true", help="also run ONNX Runtime GenAI's int4 (setup.sh ortgenai)")
    parser.add_argument("--vllm", action="store_true", help="also run vLLM's CPU build (setup.sh vllm)")
    parser.add_argument(
        "--vllm-without-amx",
        action="store_true",
        help="also run vLLM kept off AMX tiles (oneDNN capped at AVX-512 BF16, its AMX kernels not chosen)",
    )
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument(
        "--prompt-tokens",
        default=PROMPT_TOKENS,
        help="prompt lengths timed to their first token, comma-separated, ascending (decode follows first and last)",
    )
    parser.add_argument(
        "--offline-budget",
        type=int,
        default=OFFLINE_BUDGET,
        help="llmlower's max_num_batched_tokens for the 16 requests (the engine's default, 128, suits streaming)",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--json", help="also write the report here")
    args = parser.parse_args()
    for flag, given, known in (
        ("--scale-dtypes", args.scale_dtypes, SCALES),
        ("--kv-cache-dtypes", args.kv_cache_dtypes, KV_CACHES),
    ):
        unknown = set(given.split(",")) - set(known)
        if unknown:
            parser.error(f"{flag}: {', '.join(sorted(unknown))} not among {', '.join(known)}")
    torch.set_num_threads(args.threads)
    workdir = args.workdir / args.shape
    vocab = json.loads((example_checkpoint() / "config.json").read_text())["vocab_size"]
    config = SHAPES[args.shape](vocab)
    checkpoint = write_checkpoint(workdir / "checkpoint", config)
    ceilings = machine_ceilings("cpu")
    prompt_tokens = [int(n) for n in args.prompt_tokens.split(",")]
    filler = [1000 + i % 40000 for i in range(max(prompt_tokens))]
    prompts = {n: filler[:n] for n in prompt_tokens}
    offline = offline_prompts(prompts)  # the peers' own
    context = max(prompt_tokens) + args.new_tokens + 1
    read_context = prompt_tokens[0] + args.new_tokens // 2
    head, row_suffix, directory_suffix = {}, "", ""  # the LM head's option, and what it adds to the names
    if args.lm_head_bits:
        head = {"lm_head_bits": args.lm_head_bits}
        row_suffix, directory_suffix = f" int{args.lm_head_bits} head", f"-head{args.lm_head_bits}"
    builds = {  # row -> (backend, build_pipeline options, KV cache dtype, directory)
        f"llmlower {backend} {quant}{row_suffix}{scales_row}{KV_CACHES[kv][0]}": (
            backend,
            {"quant": quant, **head, **scales_options},
            kv,
            workdir / f"{backend}-{quant}{directory_suffix}{scales_directory}{KV_CACHES[kv][1]}",
        )
        for backend in args.backends.split(",")
        for quant in filter(None, args.quants.split(","))
        for scales_options, scales_row, scales_directory in (SCALES[s] for s in args.scale_dtypes.split(","))
        for kv in args.kv_cache_dtypes.split(",")
    }
    for name in filter(None, args.recipes.split(",")):
        recipe = RECIPES[name]
        directory = workdir / f"recipe-{name}"
        builds[f"llmlower recipe {name}"] = (recipe.backend, recipe.pipeline_options, recipe.kv_cache_dtype, directory)
    cpus: dict[str, str | None] = dict.fromkeys(builds)  # row -> the LLVM CPU its tvm build is for (None: this one)
    for cpu in filter(None, args.tvm_cpus.split(",")):
        for row, (backend, options, kv, directory) in list(builds.items()):
            if backend == "tvm" and cpus[row] is None:
                builds[f"{row} --cpu {cpu}"] = (backend, options, kv, directory.with_name(f"{directory.name}-{cpu}"))
                cpus[f"{row} --cpu {cpu}"] = cpu
    for row, (backend, options, kv, directory) in builds.items():  # first, alone in memory: compiling holds weights
        built_for = {"cpu": cpus[row]} if cpus[row] else None
        ensure_artifact(str(checkpoint), backend, options, directory, kv_cache_dtype=kv, compile_options=built_for)
    loaded = load(checkpoint)
    captured = capture(loaded)
    spec, parameters = loaded.spec, sum(p.numel() for p in loaded.module.parameters())
    artifact_reads = {row: artifact_read_bytes(captured, build[-1], read_context) for row, build in builds.items()}
    float32_reads = decode_read_bytes(captured, read_context)
    del loaded, captured  # the float model: a MoE one's 7 GB beside the engines ran a 24 GB VM out of memory
    dense = not getattr(config, "num_experts", None)
    rows: dict[str, dict] = {}
    reads: dict[str, int | None] = {}
    ggufs = {
        f"llama.cpp {kind}": llamacpp_gguf(checkpoint, workdir, kind)
        for kind in args.llamacpp.split(",")
        if kind != "none"
    }
    genai = genai_model(checkpoint, workdir) if args.genai else None  # every model made before anything is timed
    for name, (*_, directory) in builds.items():
        engine = Engine.load(directory, max_num_seqs=1, max_context=context, threads=args.threads)
        print(f"[shaped] {name}: batch 1", file=sys.stderr)
        row = measure(*llmlower_executor(engine.executor), prompts, args.new_tokens, args.repeats)
        del engine
        # prefix caching off, as vllm_offline.py runs vLLM: each repeat prefills its prompts again
        many = Engine.load(
            directory,
            max_num_seqs=OFFLINE_REQUESTS,
            max_num_batched_tokens=args.offline_budget,
            max_context=256,
            threads=args.threads,
            enable_prefix_caching=False,
        )
        print(f"[shaped] {name}: {OFFLINE_REQUESTS} requests", file=sys.stderr)
        runs = [offline_throughput(many, offline) for _ in range(args.repeats)]
        row[OFFLINE] = statistics.median(runs)
        del many
        rows[name], reads[name] = row, artifact_reads[name]
    for name, gguf in ggufs.items():
        print(f"[shaped] {name}: batch 1", file=sys.stderr)
        rows[name] = peer("llamacpp", gguf, prompts, args.new_tokens, args.repeats, args.threads)
        reads[name] = llamacpp_read_bytes(gguf, spec, read_context) if dense else None
    if genai is not None:
        print("[shaped] ONNX Runtime GenAI int4: batch 1", file=sys.stderr)
        rows["ONNX Runtime GenAI int4"] = peer("ortgenai", genai, prompts, args.new_tokens, args.repeats, args.threads)
        reads["ONNX Runtime GenAI int4"] = ortgenai_read_bytes(genai, spec, read_context) if dense else None
    vllm_runs = {"": None} if args.vllm else {}
    if args.vllm_without_amx:
        vllm_runs[" without AMX"] = without_amx_environment()
    for suffix, environment in vllm_runs.items():
        print(f"[shaped] vLLM CPU{suffix}", file=sys.stderr)
        row = peer(
            "vllm_offline", checkpoint, prompts, args.new_tokens, args.repeats, args.threads, "vllm", environment
        )
        name = f"vLLM CPU {row['dtype']}{suffix}"
        rows[name], reads[name] = row, float_read_bytes(float32_reads, row["dtype"])
    for name, row in rows.items():
        if reads[name]:
            row.update(bandwidth_roof(row["decode_tokens_per_s"], reads[name], ceilings.bandwidth))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    report = {
        "shape": args.shape,
        "parameters": parameters,
        "machine": machine(ceilings),
        "date": datetime.date.today().isoformat(),
        "commit": commit,
        "threads": args.threads,
        "offline_budget": args.offline_budget,
        "decode_context": read_context,
        "dense_equivalent_bytes_per_token": dense_equivalent_read_bytes(
            config, next(iter(builds.values()))[1], read_context
        ),
        "rows": rows,
    }
    print(f"{args.shape}, {report['parameters'] / 1e9:.2f} B parameters; {report['machine']}")
    print(f"16 requests: llmlower at {args.offline_budget} tokens a step (--offline-budget)")
    print(f"{report['date']}, commit {commit}; medians of {args.repeats}")
    print_table(rows, prompt_tokens)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
