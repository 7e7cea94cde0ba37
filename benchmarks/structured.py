"""What structured output costs per token: llguidance's mask, the sampler applying it, and a batch-1 decode's share.

Masks: a JSON schema (an object of bounded strings, numbers, an enum and an array) and a regex, each walked token
by token by a random model (every next token drawn uniformly from the mask, seeded; a walk restarts once its
grammar is done) until --tokens masks were computed; per grammar and tokenizer the median and p90 of
Constraint.mask() (llguidance writes the packed bitmask into a new numpy array), the first compile of the grammar,
and what Sampler.sample spends more with the walk's masks than without (random logits, batch 1: greedy, where a
refused argmax costs an unpacked mask, and temperature 1). Tokenizers: SmolLM2's (49,152 tokens, from the example
checkpoint) and the tests' tiny byte-level BPE (320 tokens).

Decode (unless --no-decode): --model (a checkpoint on the torch reference backend, or an artifact as compiled)
generates --decode-tokens tokens at batch 1 under a JSON schema of one string too long to end early (the costly
case: nearly every token is allowed); the time in mask(), accept() and the sampler per token against the whole
step, with the same decode unconstrained for the sampler's own time.

    .venv/bin/python benchmarks/structured.py [--model example|CHECKPOINT|ARTIFACT] [--tokens 5000]
        [--decode-tokens 64] [--no-decode]
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import numpy as np
from profile_step import timed

from llmlower.frontend.example import example_checkpoint
from llmlower.runtime import Engine, SamplingParams, Tokenizer
from llmlower.runtime.artifact import is_artifact, read_manifest
from llmlower.runtime.detokenizer import eos_token_ids
from llmlower.runtime.sampler import Sampler, SequenceSampling, allowed_tokens
from llmlower.runtime.structured import Constraint, GrammarCompiler, StructuredOutput
from llmlower.testing import EOS, VOCAB, build_tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "score": {"type": "number", "minimum": 0, "maximum": 10, "multipleOf": 0.25},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
    },
    "required": ["name", "age", "score", "role", "tags"],
    "additionalProperties": False,
}
REGEX = r"[A-Z][a-z]{2,10}( [A-Z][a-z]{2,10}){0,3}, [0-9]{5}(-[0-9]{4})?, (Mon|Tue|Wed|Thu|Fri) [0-9]{1,2}:[0-9]{2}"
GRAMMARS = {"JSON schema": StructuredOutput(json=SCHEMA), "regex": StructuredOutput(regex=REGEX)}


def walk(compiler: GrammarCompiler, output: StructuredOutput, vocab: int, count: int) -> tuple[list[float], list]:
    """Seconds of `count` mask() calls along seeded random walks through `output`'s grammar, and the masks."""
    rng = np.random.default_rng(0)
    times: list[float] = []
    masks: list[np.ndarray] = []
    while len(times) < count:
        constraint = compiler.constraints(output, 1)[0]
        while not constraint.finished and len(times) < count:
            started = time.perf_counter()
            mask = constraint.mask()
            times.append(time.perf_counter() - started)
            masks.append(mask)
            constraint.accept(int(rng.choice(np.flatnonzero(allowed_tokens(mask, vocab)))))
    return times, masks


def sampler_cost(masks: list[np.ndarray], vocab: int, temperature: float) -> float:
    """Median seconds Sampler.sample spends more with each mask than without (random logits, batch 1)."""
    sampler = Sampler([EOS], np.random.default_rng(0))
    state = [SequenceSampling(SamplingParams(temperature=temperature))]
    logits = np.random.default_rng(1).normal(size=(len(masks), 1, vocab)).astype(np.float32)
    extra = []
    for row, mask in zip(logits, masks, strict=True):
        timings = []
        for given in (None, [mask]):
            started = time.perf_counter()
            sampler.sample(row, state, [[]], [[]], given)
            timings.append(time.perf_counter() - started)
        extra.append(timings[1] - timings[0])
    return float(np.median(extra))


def mask_rows(tokenizers: dict[str, tuple[str, int, int]], count: int) -> None:
    print("| tokenizer | grammar | masks | mask median µs | mask p90 µs | compile ms | sampler +µs greedy | +µs T=1 |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for label, (text, vocab, eos) in tokenizers.items():
        compiler = GrammarCompiler(text, vocab, [eos])
        for name, output in GRAMMARS.items():
            started = time.perf_counter()
            compiler.check(output)
            compile_ms = (time.perf_counter() - started) * 1e3
            times, masks = walk(compiler, output, vocab, count)
            median, p90 = (float(np.percentile(times, q)) * 1e6 for q in (50, 90))
            greedy, drawn = (sampler_cost(masks[:500], vocab, t) * 1e6 for t in (0.0, 1.0))
            print(
                f"| {label} | {name} | {len(times)} | {median:.1f} | {p90:.1f} | {compile_ms:.1f} | {greedy:.1f} "
                f"| {drawn:.1f} |"
            )


def decode_row(model: str, tokens: int) -> None:
    """A batch-1 decode under a JSON schema (a string too long to end early) against the same one unconstrained."""
    from llmlower.api import load_engine

    limits = {"max_num_seqs": 1, "max_context": 512}
    engine = Engine.load(model, **limits) if is_artifact(model) else load_engine(model, **limits)
    long = {"type": "object", "properties": {"text": {"type": "string", "minLength": tokens * 8}}, "required": ["text"]}
    constrained = SamplingParams(temperature=0, max_tokens=tokens, structured_output=StructuredOutput(json=long))
    free = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    engine.generate(["Warm up"], free, chat=False)
    totals: dict[str, dict[str, float]] = {}
    originals = {"mask": Constraint.mask, "accept": Constraint.accept, "sample": engine.sampler.sample}
    originals["step"] = engine.executor.step
    for label, params in (("free", free), ("constrained", constrained)):
        totals[label] = defaultdict(float)
        Constraint.mask = timed(totals[label], "mask", originals["mask"])
        Constraint.accept = timed(totals[label], "accept", originals["accept"])
        engine.sampler.sample = timed(totals[label], "sample", originals["sample"])
        engine.executor.step = timed(totals[label], "step", originals["step"])
        result = engine.generate(["Describe the weather as JSON:"], params, chat=False)[0]
        totals[label]["tokens"] = len(result.token_ids)
    Constraint.mask, Constraint.accept = originals["mask"], originals["accept"]
    per = {label: {k: v / t["tokens"] * 1e6 for k, v in t.items()} for label, t in totals.items()}
    c, f = per["constrained"], per["free"]
    extra = c["mask"] + c["accept"] + c["sample"] - f["sample"]
    backend = read_manifest(model)["backend"] if is_artifact(model) else "torch"
    print(f"\ndecode at batch 1, {model} ({backend}), {int(totals['constrained']['tokens'])} tokens (µs per token)")
    print("| run | executor step | sampler | mask() | accept() | structured output's extra | share of the token |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    print(f"| unconstrained | {f['step']:.0f} | {f['sample']:.1f} | - | - | - | - |")
    total = c["step"] + c["sample"] + c["mask"] + c["accept"]
    print(
        f"| JSON schema | {c['step']:.0f} | {c['sample']:.1f} | {c['mask']:.1f} | {c['accept']:.1f} "
        f"| {extra:.1f} | {extra / total:.2%} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="example", help="the checkpoint of the decode row (default: SmolLM2)")
    parser.add_argument("--tokens", type=int, default=5000, help="masks per grammar and tokenizer")
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--no-decode", action="store_true")
    args = parser.parse_args()
    smollm2 = example_checkpoint()
    tokenizer = Tokenizer.from_dir(smollm2)
    tokenizers = {
        f"SmolLM2 ({tokenizer.vocab_size:,})": (
            tokenizer.to_json(),
            tokenizer.vocab_size,
            min(eos_token_ids(None, tokenizer)),
        ),
        f"tiny BPE ({VOCAB})": (build_tokenizer().to_str(), VOCAB, EOS),
    }
    mask_rows(tokenizers, args.tokens)
    if not args.no_decode:
        decode_row(str(smollm2) if args.model == "example" else args.model, args.decode_tokens)


if __name__ == "__main__":
    main()
