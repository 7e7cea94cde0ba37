"""Architecture coverage: every tiny architecture of the tests (random weights, built here) compiled in fp32 by each
CPU backend; each artifact generates greedily for a few prompts at once and its tokens are compared with
transformers' own. Prints (and with --out writes) the family x backend table: exact, the first differing token, or
the one-line reason it does not compile. `--held-out` adds families the tests do not build (HELD_OUT), checked
here only: the mechanism on cases it was not written against.

    .venv/bin/python benchmarks/coverage.py --out coverage.md
    .venv/bin/python benchmarks/coverage.py --held-out --families --out held-out.md   # the held-out ones alone
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import transformers

from llmlower.api import compile_artifact
from llmlower.errors import LlmlowerError
from llmlower.progress import stage
from llmlower.runtime import Engine, SamplingParams
from llmlower.testing import COMMON, MAMBA2, TINY_CONFIGS, transformers_greedy, write_tiny_checkpoint

BACKENDS = ("onnx", "tvm", "mlir")
# families outside the tests' TINY_CONFIGS, in the same tiny sizes
HELD_OUT = {
    "cohere": lambda: transformers.CohereConfig(**COMMON),
    "cohere2": lambda: transformers.Cohere2Config(**COMMON, sliding_window=6),
    "falcon": lambda: transformers.FalconConfig(
        vocab_size=320,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_kv_heads=2,
        new_decoder_architecture=True,
        bos_token_id=1,
        eos_token_id=4,
        initializer_range=0.1,
        max_position_embeddings=128,
    ),  # fmt: skip
    "hunyuan_v1_dense": lambda: transformers.HunYuanDenseV1Config(**COMMON, head_dim=16, pad_token_id=0),
    "deepseek_v2": lambda: transformers.DeepseekV2Config(  # latent attention with a complex rotary
        **{**COMMON, "num_key_value_heads": 4},
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        n_shared_experts=1,
        first_k_dense_replace=1,
        kv_lora_rank=16,
        q_lora_rank=24,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
    ),
    "olmo_hybrid": lambda: transformers.OlmoHybridConfig(**{**COMMON, "num_hidden_layers": 4}, pad_token_id=0),
    "bamba": lambda: transformers.BambaConfig(**{**COMMON, "num_hidden_layers": 3}, attn_layer_indices=[1], **MAMBA2),
    "falcon_mamba": lambda: transformers.FalconMambaConfig(
        vocab_size=320,
        hidden_size=64,
        num_hidden_layers=2,
        state_size=8,
        expand=1,
        conv_kernel=4,
        bos_token_id=1,
        eos_token_id=4,
        pad_token_id=0,
    ),  # fmt: skip
}
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
            checkpoint = write_tiny_checkpoint(family, Path(root) / family / "checkpoint", HELD_OUT.get(family))
            cells = []
            for backend in backends:
                with stage(f"{family} on {backend}"):
                    cells.append(verdict(checkpoint, backend, Path(root) / family).replace(f"{root}/", ""))
            rows.append(f"| {family} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="*", default=list(TINY_CONFIGS), choices=[*TINY_CONFIGS, *HELD_OUT])
    parser.add_argument("--held-out", action="store_true", help="also the families the tests do not build")
    parser.add_argument("--backends", nargs="*", default=list(BACKENDS), choices=list(BACKENDS))
    parser.add_argument("--out", type=Path, help="also write the table (Markdown) here")
    args = parser.parse_args()
    result = table(args.families + (list(HELD_OUT) if args.held_out else []), args.backends)
    print(result)
    if args.out:
        args.out.write_text(result + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
