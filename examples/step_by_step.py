"""The compiler's stages one at a time on the example model: load, capture, passes, run.

    .venv/bin/python examples/step_by_step.py [MODEL] [--dump DIR]

Prints the ModelSpec, what each pass did, and a greedy chat answer from the rewritten program.
"""

from __future__ import annotations

import argparse

from llmlower.backends.torch.program_executor import TorchExecutor
from llmlower.frontend import capture, load, resolve_model
from llmlower.passes import DEFAULT_PIPELINE, run_pipeline
from llmlower.runtime import Engine, Tokenizer
from llmlower.runtime.sampling_params import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model", nargs="?", default="example")
    parser.add_argument("--dump", help="write the graph's code before and after each pass here")
    args = parser.parse_args()

    loaded = load(resolve_model(args.model))
    spec = loaded.spec
    print(f"{spec.architecture}: {spec.num_layers} layers, {spec.num_heads} heads, {spec.num_kv_heads} kv heads")
    print(f"KV cache: {spec.kv_bytes_per_token():,} bytes per token ({spec.dtype})")

    program = run_pipeline(capture(loaded), DEFAULT_PIPELINE, verify=True, dump_dir=args.dump)
    for record in program.history:
        print(
            f"{record.name:<13} {record.stats['nodes_before']:>5} -> {record.stats['nodes']:>5} nodes, "
            f"max relative error {record.max_error:.1e}, {record.seconds:.1f}s"
        )

    files = loaded.tokenizer
    engine = Engine(
        TorchExecutor(program, max_context=512),
        Tokenizer(files.tokenizer_json, files.config, files.chat_template),
        spec,
    )
    [result] = engine.generate(["Explain a KV cache in one sentence."], SamplingParams(temperature=0, max_tokens=48))
    print(result.text)
    print(f"finish_reason={result.finish_reason}, {result.timing.decode_tokens_per_s:.1f} tokens/s")


if __name__ == "__main__":
    main()
