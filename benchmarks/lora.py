"""LoRA adapters on SmolLM2: what adapter slots cost, and that an adapter answers as PEFT's merged model.

Two random PEFT adapters (every linear, ranks 16 and 8, B scaled up so that they change the answers) are made with
PEFT on the checkpoint. Exactness: the `exact` recipe with slots, each adapter's greedy tokens against PEFT's merged
model run by transformers. Speed: the default (auto) recipe compiled with and without 4 slots of rank 16; batch-1
decode of the base model on both, and of an adapter; 4 streams of 4 different adapters against 4 base streams
(tokens per second over the whole batch). Medians over --repeats, the runs taking turns.

    .venv/bin/python benchmarks/lora.py [--model example] [--repeats 3] [--tokens 128]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import peft
import torch
import transformers

from llmlower.api import compile_model
from llmlower.frontend import resolve_model
from llmlower.runtime import Engine, SamplingParams
from llmlower.runtime.cpu_features import host_cpu_flags
from llmlower.testing import transformers_greedy

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANKS = {"first": 16, "second": 8}
SLOTS = {"rank": 16, "max_loras": 4}
PROMPTS = ["What is a compiler?", "Write a haiku about the sea.", "List three prime numbers."]
ISA = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile")


def make_adapters(checkpoint: Path, out: Path) -> dict[str, Path]:
    """Random PEFT adapters on every linear, saved by PEFT, with each one's merged model beside it."""
    adapters = {}
    for seed, (name, rank) in enumerate(RANKS.items()):
        torch.manual_seed(seed)
        config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, init_lora_weights=False)
        model = peft.get_peft_model(
            transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32), config
        )
        with torch.no_grad():
            for parameter_name, parameter in model.named_parameters():
                if "lora_B" in parameter_name:
                    parameter.mul_(4)
        model.save_pretrained(out / name)
        model.merge_and_unload().save_pretrained(out / f"{name}-merged")
        transformers.AutoTokenizer.from_pretrained(checkpoint).save_pretrained(out / f"{name}-merged")
        adapters[name] = out / name
    return adapters


def exactness(checkpoint: Path, adapters: dict[str, Path], out: Path, tokens: int) -> None:
    """Each adapter's greedy tokens on the exact recipe against PEFT's merged model's."""
    artifact = compile_model(checkpoint, out / "exact-lora", "exact", lora=SLOTS)
    engine = Engine.load(artifact, loras=adapters)
    for name, path in adapters.items():
        merged = path.with_name(f"{name}-merged")
        ids = [engine.prompt_token_ids(prompt) for prompt in PROMPTS]
        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, lora=name)
        results = engine.generate(ids, params, chat=False)
        same = [
            result.token_ids == transformers_greedy(merged, prompt, tokens)
            for prompt, result in zip(ids, results, strict=True)
        ]
        print(
            f"exact recipe, adapter {name} (rank {RANKS[name]}): {sum(same)}/{len(same)} prompts give PEFT "
            f"merge_and_unload's {tokens} greedy tokens",
            flush=True,
        )


def decode_rate(engine: Engine, loras: list[str | None], tokens: int) -> float:
    """Generated tokens per second of len(loras) streams at once (one prompt each, greedy, no early stop)."""
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(loras))]
    params = [SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, lora=lora) for lora in loras]
    started = time.perf_counter()
    results = engine.generate(prompts, params)
    if len(loras) == 1:
        return results[0].timing.decode_tokens_per_s
    return sum(len(r.token_ids) for r in results) / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="example")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    flags = host_cpu_flags() or set()
    print("CPU ISA:", ", ".join(flag for flag in ISA if flag in flags) or "none listed", flush=True)
    checkpoint = resolve_model(args.model)
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch)
        adapters = make_adapters(checkpoint, out)
        exactness(checkpoint, adapters, out, 32)
        plain = Engine.load(compile_model(checkpoint, out / "auto", "auto"), max_num_seqs=4)
        slotted = Engine.load(compile_model(checkpoint, out / "auto-lora", "auto", lora=SLOTS), max_num_seqs=4)
        slotted.load_lora("third", adapters["first"])
        slotted.load_lora("fourth", adapters["second"])
        for name, path in adapters.items():
            slotted.load_lora(name, path)
        runs = {
            "batch 1, no slots": (plain, [None]),
            "batch 1, slots, base model": (slotted, [None]),
            "batch 1, slots, an adapter": (slotted, ["first"]),
            "4 streams, no slots": (plain, [None] * 4),
            "4 streams, 4 adapters": (slotted, ["first", "second", "third", "fourth"]),
        }
        rates: dict[str, list[float]] = {name: [] for name in runs}
        for repeat in range(args.repeats):
            for name, (engine, loras) in runs.items():
                rates[name].append(decode_rate(engine, loras, args.tokens))
            print(f"round {repeat + 1} of {args.repeats} done", flush=True)
    base = statistics.median(rates["batch 1, no slots"])
    streams = statistics.median(rates["4 streams, no slots"])
    print(f"\nrecipe auto, {args.tokens} greedy tokens, medians of {args.repeats}; slots: {SLOTS}")
    print("| run | tok/s | vs no slots |\n|---|---:|---:|")
    for name, values in rates.items():
        reference = streams if name.startswith("4 streams") else base
        median = statistics.median(values)
        print(f"| {name} | {median:.1f} | {median / reference:.2f}x |")


if __name__ == "__main__":
    main()
