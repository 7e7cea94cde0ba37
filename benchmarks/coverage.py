"""Architecture coverage: every tiny architecture of the tests (random weights, built here) compiled in fp32 by each
CPU backend; each artifact generates greedily for a few prompts at once and its tokens are compared with
transformers' own. Prints (and with --out writes) the family x backend table: exact, the first differing token, or
the one-line reason it does not compile.

    .venv/bin/python benchmarks/coverage.py --out coverage.md
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from llmlower.api import compile_artifact
from llmlower.errors import LlmlowerError
from llmlower.progress import stage
from llmlower.runtime import Engine, SamplingParams
from llmlower.testing import TINY_CONFIGS, transformers_greedy, write_tiny_checkpoint

BACKENDS = ("onnx", "tvm", "mlir")
PROMPTS = ["The quick brown fox jumps over the lazy dog.", "def add(a, b):", "keys and values", "東京"]
NEW_TOKENS = 8


def verdict(checkpoint: Path, backend: str, directory: Path) -> str:
    """'exact', 'differs at token N of prompt P', or why the family does not compile or run on `backend`."""
    try:
        artifact = compile_artifact(checkpoint, directory / backend, backend=backend)
        engine = Engine.load(artifact, max_num_seqs=len(PROMPTS), max_context=128, max_num_batched_tokens=16)
        results = engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    except LlmlowerError as error:
        return f"fails: {_first_line(error)}"
    except Exception as error:  # a crash with no error of the project's own is a bug to report as one
        return f"crashes: {type(error).__name__}: {_first_line(error)}"
    for index, result in enumerate(results):
        expected = transformers_greedy(checkpoint, result.prompt_token_ids, NEW_TOKENS)
        if result.token_ids != expected:
            first = next(i for i, (a, b) in enumerate(zip(result.token_ids, expected, strict=True)) if a != b)
            return f"differs at token {first} of prompt {index}"
    return "exact"


def _first_line(error: Exception) -> str:
    return (str(error).strip().splitlines() or [""])[0][:160].replace("|", "/")


def table(families: list[str], backends: list[str]) -> str:
    rows = ["| family | " + " | ".join(backends) + " |", "|---|" + "---|" * len(backends)]
    with tempfile.TemporaryDirectory() as root:
        for family in families:
            checkpoint = write_tiny_checkpoint(family, Path(root) / family / "checkpoint")
            cells = []
            for backend in backends:
                with stage(f"{family} on {backend}"):
                    cells.append(verdict(checkpoint, backend, Path(root) / family).replace(f"{root}/", ""))
            rows.append(f"| {family} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="*", default=list(TINY_CONFIGS), choices=list(TINY_CONFIGS))
    parser.add_argument("--backends", nargs="*", default=list(BACKENDS), choices=list(BACKENDS))
    parser.add_argument("--out", type=Path, help="also write the table (Markdown) here")
    args = parser.parse_args()
    result = table(args.families, args.backends)
    print(result)
    if args.out:
        args.out.write_text(result + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
