"""ONNX Runtime GenAI serving N client streams with static batches, for benchmarks/serving.py (see docs/benchmarks.md).

ORT GenAI on the CPU runs one static batch per Generator: no request joins a batch once it has started. So the
requests are served in waves: take up to --max-batch requests that have arrived (oldest first), prefill them as one
right-padded batch, decode until every row has its new tokens, then start the next wave. A stream sends its next
request when its previous one finishes, so a request's TTFT includes waiting for the wave before it. Prints one JSON
line: the token times of every request, in seconds from the start of the run (progress on stderr).

.venv-ortgenai/bin/python ortgenai_serving.py --model DIR --workload W.json [--max-batch N] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnxruntime
import onnxruntime_genai as og
from ortgenai import load_model

Clock = Callable[[], float]


MAX_BATCH = 32  # onnxruntime-genai 0.18 refuses larger batches: "batch_size (64) must be in [1, 32]"


def parse() -> tuple[argparse.Namespace, dict]:
    """The arguments and the workload: {"streams": [[prompt ids, ...] per stream], "stagger_s", "new_tokens"}."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="ORT GenAI model folder (genai_config.json)")
    parser.add_argument("--workload", required=True, help="JSON written by benchmarks/serving.py")
    parser.add_argument("--max-batch", type=int, help="most requests per wave (default: the number of streams)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    with open(args.workload) as f:
        return args, json.load(f)


def pad_token_id(model_dir: str) -> int:
    """The token ORT GenAI reads as padding (genai_config.json's model.pad_token_id)."""
    return json.loads((Path(model_dir) / "genai_config.json").read_text())["model"]["pad_token_id"]


def run_wave(model: og.Model, prompts: list[list[int]], new_tokens: int, pad: int, clock: Clock) -> list[float]:
    """Generate new_tokens greedy tokens (EOS masked) for every prompt as one static batch; the time each step's
    tokens were ready (all rows get theirs at once)."""
    longest = max(len(ids) for ids in prompts)
    params = og.GeneratorParams(model)
    # Lengths count the padded prompt; min_length == max_length masks EOS (also the pad token here) to the end.
    length = longest + new_tokens
    params.set_search_options(batch_size=len(prompts), do_sample=False, max_length=length, min_length=length)
    generator = og.Generator(model, params)
    ids = np.full((len(prompts), longest), pad, dtype=np.int32)  # right-padded, as og.Tokenizer.encode_batch does
    for row, prompt in enumerate(prompts):
        ids[row, : len(prompt)] = prompt
    generator.append_tokens(ids)  # the prefill: ORT GenAI masks the trailing pads and reads each row's last token
    times = []
    while not generator.is_done():
        generator.generate_next_token()  # the first only picks from the prefill's logits; then a forward pass each
        times.append(clock())
    assert len(times) == new_tokens, (len(times), new_tokens)
    return times


def check_prompts(streams: list[list[list[int]]], pad: int) -> None:
    """A prompt ending in the pad token would lose that token to the padding mask: refuse it."""
    for stream, prompts in enumerate(streams):
        for index, ids in enumerate(prompts):
            if not ids or ids[-1] == pad:
                raise SystemExit(f"stream {stream} request {index}: empty or ends with the pad token {pad}")


def serve(model: og.Model, workload: dict, max_batch: int, pad: int) -> tuple[list[dict], list[int]]:
    """Serve the streams in waves in real time; returns a record per request and the size of each wave."""
    streams, new_tokens = workload["streams"], workload["new_tokens"]
    next_index = [0] * len(streams)
    arrival: dict[int, float] = {i: i * workload["stagger_s"] for i in range(len(streams))}  # stream -> next request
    records, waves = [], []
    start = time.perf_counter()

    def clock() -> float:
        return time.perf_counter() - start

    while arrival:
        now = clock()
        ready = sorted((t, i) for i, t in arrival.items() if t <= now)[:max_batch]
        if not ready:
            time.sleep(min(arrival.values()) - now)
            continue
        prompts = [streams[i][next_index[i]] for _, i in ready]
        times = run_wave(model, prompts, new_tokens, pad, clock)
        waves.append(len(ready))
        print(
            f"[ortgenai_serving] wave {len(waves)}: {len(ready)} requests, done at {times[-1]:.1f} s", file=sys.stderr
        )
        for (arrived, i), ids in zip(ready, prompts, strict=True):
            records.append({"stream": i, "index": next_index[i], "prompt_tokens": len(ids), "arrival_s": arrived})
            records[-1]["token_times_s"] = times
            next_index[i] += 1
            del arrival[i]
            if next_index[i] < len(streams[i]):
                arrival[i] = times[-1]  # the stream's next request leaves as soon as this one is done
    return records, waves


def warm_up(model: og.Model, pad: int) -> None:
    """A padded batch of a 512-token and an 8-token prompt, 4 tokens each, so that the timed run does not pay for
    first-run allocations (serving.py warms llmlower's engines up the same way)."""
    prompts = [[10 + i % 1000 for i in range(512)], list(range(10, 18))]
    run_wave(model, prompts, 4, pad, time.perf_counter)


def main() -> None:
    """Parse the arguments, serve the workload, print the JSON line."""
    args, workload = parse()
    pad = pad_token_id(args.model)
    check_prompts(workload["streams"], pad)
    model = load_model(args.model, args.threads)
    warm_up(model, pad)
    max_batch = min(args.max_batch or len(workload["streams"]), MAX_BATCH)
    records, waves = serve(model, workload, max_batch, pad)
    version = f"{og.__version__} (onnxruntime {onnxruntime.__version__})"
    print(json.dumps({"engine": "onnxruntime-genai", "version": version, "records": records, "waves": waves}))


if __name__ == "__main__":
    main()
