"""compile --verify's last check, and every compile's through the cache (generate, chat, serve): the finished
artifact, still in its staging directory, runs through its own runtime executor (loaded as Engine.load loads it)
beside the torch reference executor on the same Program and block tables, over a prefill of sequences of
different lengths (the longest in two chunks, its second beside the others' first decode) and greedy decode
steps; an artifact whose logits, or a hybrid model's recurrent states, differ by more than its backend's
tolerance (backends.backend.Tolerance) is refused, so it is never moved into place. Greedy tokens are compared
too and reported (within the tolerance they can differ only where the reference's top two logits are nearer than
twice the tolerance)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .backends.registry import get_backend
from .backends.torch.program_executor import TorchExecutor
from .errors import VerificationError
from .ir import Program
from .progress import stage
from .runtime.artifact import read_manifest
from .runtime.executor import Executor, StepBatch, sequential_block_tables
from .runtime.executors import executor_of, load_executor
from .step_io import DEFAULT_BLOCK_SIZE

PROMPT_LENS = (5, 9, 3)  # the prefill: three sequences of different lengths
CHUNKED, FIRST_CHUNK = 1, 4  # the second arrives in two chunks: its first 4 tokens, then the rest
DECODE_STEPS = 4
FIRST_TOKEN = 5  # prompt token ids are drawn from FIRST_TOKEN up, past the usual special tokens


@dataclass(frozen=True)
class StepDifference:
    """One step's comparison: its name, the largest |logit difference|, the reference's largest |logit| (at least
    1) that scales it, whether every sequence's argmax agrees, and the recurrent state that differs most (relative
    to its own largest value) with that error, if the model keeps one."""

    step: str
    difference: float
    scale: float
    same_tokens: bool
    state: str | None = None
    state_error: float = 0.0

    @property
    def error(self) -> float:
        """The difference relative to the reference's scale (what the tolerance bounds); NaN stays NaN."""
        return self.difference / self.scale


def skip_reason(staging: Path, manifest: dict[str, Any]) -> str | None:
    """Why this machine cannot run the artifact (a GPU target, a module for other compilers, a library for
    another CPU), or None."""
    if manifest["target"] != "cpu":
        return f"a {manifest['target']} artifact runs on a GPU; verification runs artifacts on this machine's CPU"
    return executor_of(staging, manifest).refusal(manifest)


def executors(program: Program, staging: Path, manifest: dict[str, Any]) -> tuple[Executor, TorchExecutor]:
    """The artifact's executor (load_executor, as Engine.load uses it) and the torch reference on `program`,
    each with room for PROMPT_LENS's sequences and the decode steps, in the same blocks."""
    context = min(max(PROMPT_LENS) + DECODE_STEPS + 1, program.spec.max_positions)
    block_size = manifest["kv_layout"].get("block_size") or DEFAULT_BLOCK_SIZE
    num_blocks = len(PROMPT_LENS) * -(-context // block_size)
    ours = load_executor(staging, manifest, num_blocks, block_size, context)
    return ours, TorchExecutor(program, context, num_blocks, block_size)


def _state_error(ours: Executor, reference: TorchExecutor) -> tuple[str | None, float]:
    """The recurrent state whose rows differ most between the executors, relative to the reference's largest value
    (at least 1), and that error; (None, 0) for a model without one."""
    errors = {
        name: float(np.abs(state - reference.states[name]).max())
        / max(1.0, float(np.abs(reference.states[name]).max()))
        for name, state in ours.states.items()
    }
    worst = max(errors, key=errors.get, default=None)
    return worst, errors.get(worst, 0.0)


def compared_steps(ours: Executor, reference: TorchExecutor, vocab: int) -> Iterator[StepDifference]:
    """The prefill of PROMPT_LENS's sequences (random token ids, seed 0; the CHUNKED one's in two chunks, its second
    beside the others' first decode), then DECODE_STEPS decode steps each feeding both executors the reference's
    greedy tokens, compared step by step on the same block tables."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(min(FIRST_TOKEN, vocab - 1), vocab, n).tolist() for n in PROMPT_LENS]
    tables = sequential_block_tables(ours, [n + DECODE_STEPS + 1 for n in PROMPT_LENS])
    tokens = [p[:FIRST_CHUNK] if i == CHUNKED else p for i, p in enumerate(prompts)]
    past = [0] * len(PROMPT_LENS)
    names = ["prefill", "second chunk", *(f"decode step {i}" for i in range(1, DECODE_STEPS + 1))]
    for name in names:
        batch = StepBatch(tokens, past, tables)
        expected, got = reference.step(batch), ours.step(batch)
        yield StepDifference(
            name,
            float(np.abs(got - expected).max()),
            max(1.0, float(np.abs(expected).max())),
            bool((got.argmax(-1) == expected.argmax(-1)).all()),
            *_state_error(ours, reference),
        )
        past = [p + len(t) for p, t in zip(past, tokens, strict=True)]
        tokens = [
            prompts[i][past[i] :] if past[i] < len(prompts[i]) else [int(row.argmax())]
            for i, row in enumerate(expected)
        ]


def rounds_activations(program: Program, manifest: dict[str, Any]) -> bool:
    """Whether the artifact rounds activations where the reference may round them a step apart: quantized matmuls
    with an accuracy_level above 0 in its backend's manifest entry (ONNX Runtime's MatMulNBits then quantizes
    activations to int8 per block; the other backends dequantize the weights and compute in the artifact's dtype),
    or an int8 KV cache (a key a hair from a rounding tie lands on either step)."""
    passes = {record.name for record in program.history}
    if "kv_cache_dtype" in passes:
        return True
    quantized = bool(passes & {"quantize_weights", "gptq"})
    return quantized and manifest.get(manifest["backend"], {}).get("accuracy_level", 0) > 0


def verify_artifact(program: Program, staging: Path) -> None:
    """Run the artifact in `staging` (complete, manifest included) against the torch reference on `program`,
    the Program it was built from; raise VerificationError naming the backend, the first step whose error exceeds
    the tolerance, the error and the tolerance. An artifact this machine cannot run is skipped, saying why."""
    manifest = read_manifest(staging)
    backend = manifest["backend"]
    with stage(f"verify the {backend} artifact against the torch reference") as shown:
        reason = skip_reason(staging, manifest)
        if reason is not None:
            shown.detail = f"skipped: {reason}"
            return
        tolerance = get_backend(backend).tolerance.of(manifest["dtype"], rounds_activations(program, manifest))
        ours, reference = executors(program, staging, manifest)
        steps = []
        for compared in compared_steps(ours, reference, program.spec.vocab_size):
            if not compared.error <= tolerance:  # NaN fails too
                raise VerificationError(
                    f"the {backend} artifact differs from the torch reference ({compared.step}): logits off by "
                    f"{compared.error:.3g} of their scale (max |difference| {compared.difference:.3g}, largest "
                    f"|logit| {compared.scale:.3g}) > tolerance {tolerance:g}; nothing written"
                )
            if not compared.state_error <= tolerance:
                raise VerificationError(
                    f"the {backend} artifact differs from the torch reference ({compared.step}): recurrent state "
                    f"{compared.state} off by {compared.state_error:.3g} of its scale > tolerance {tolerance:g}; "
                    "nothing written"
                )
            steps.append(compared)
        worst = max(steps, key=lambda s: s.error)
        agree = sum(s.same_tokens for s in steps)
        shown.detail = (
            f"largest error {worst.error:.2g} ({worst.step}; tolerance {tolerance:g}), greedy tokens agree at {agree} "
            f"of {len(steps)} steps"
        )
