"""Decode speed and TTFT of ONNX Runtime GenAI on token prompts; prints one JSON line (see docs/benchmarks.md).

.venv-ortgenai/bin/python ortgenai.py --model DIR --prompts P.json [--new-tokens N] [--repeats N] [--threads N]
"""

from __future__ import annotations

import json
import time

import numpy as np
import onnxruntime
import onnxruntime_genai as og
from runner import parse, report


def load_model(path: str, threads: int) -> og.Model:
    """Load the builder's output with the given number of intra-op threads on the CPU EP."""
    config = og.Config(path)
    config.clear_providers()
    options = {"intra_op_num_threads": threads, "inter_op_num_threads": 1}
    config.overlay(json.dumps({"model": {"decoder": {"session_options": options}}}))
    return og.Model(config)


def new_generator(model: og.Model, max_length: int) -> og.Generator:
    """A fresh greedy generator whose KV buffer holds max_length tokens and which never stops at EOS."""
    params = og.GeneratorParams(model)
    # min_length == max_length masks EOS until the end, so generation never stops early.
    params.set_search_options(do_sample=False, max_length=max_length, min_length=max_length)
    return og.Generator(model, params)


def prefill_time(model: og.Model, ids: list[int], max_length: int) -> float:
    """Seconds to feed ids to a fresh generator and get the logits of the last position."""
    generator = new_generator(model, max_length)
    started = time.perf_counter()
    generator.append_tokens(np.array(ids, dtype=np.int32))
    generator.get_logits()
    return time.perf_counter() - started


def decode_speed(model: og.Model, ids: list[int], new_tokens: int, max_length: int) -> float:
    """Tokens/s of the new_tokens - 1 greedy steps that follow the prefill of ids and its first token."""
    generator = new_generator(model, max_length)
    generator.append_tokens(np.array(ids, dtype=np.int32))
    generator.generate_next_token()  # argmax of the prefill's logits: no forward pass
    started = time.perf_counter()
    for _ in range(new_tokens - 1):
        generator.generate_next_token()  # one forward pass on the last token, then argmax
    elapsed = time.perf_counter() - started
    assert generator.token_count() == len(ids) + new_tokens, generator.token_count()
    return (new_tokens - 1) / elapsed


def main() -> None:
    """Parse the arguments, measure, print the JSON line."""
    args, prompts = parse(__doc__.splitlines()[0], "ORT GenAI model folder (genai_config.json)")
    max_length = max(len(ids) for ids in prompts.values()) + args.new_tokens
    model = load_model(args.model, args.threads)
    report(
        "ortgenai",
        "onnxruntime-genai",
        f"{og.__version__} (onnxruntime {onnxruntime.__version__})",
        prompts,
        args,
        lambda ids: prefill_time(model, ids, max_length),
        lambda ids, new_tokens: decode_speed(model, ids, new_tokens, max_length),
    )


if __name__ == "__main__":
    main()
