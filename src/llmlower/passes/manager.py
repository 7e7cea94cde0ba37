"""The pass manager: runs a named pipeline, records per-pass stats, dumps graphs, verifies each pass."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ..errors import PassError
from ..ir.program import INPUT_LENS, LOGITS, PassRecord, Program, example_inputs, paged_example_inputs
from ..progress import stage
from ..step_io import KVLayout, cache_layer
from .registry import PASSES, Verification

PassSpec = str | tuple[str, dict[str, Any]]

VERIFY_BATCH, VERIFY_TOKENS, VERIFY_CONTEXT = 3, 6, 16


def pass_steps(pipeline: Sequence[PassSpec]) -> list[tuple[str, dict[str, Any]]]:
    """(name, options) per pass, each options dict a copy the caller may change."""
    return [(p, {}) if isinstance(p, str) else (p[0], dict(p[1])) for p in pipeline]


def pass_specs(steps: Sequence[tuple[str, dict[str, Any]]]) -> list[PassSpec]:
    """pass_steps' inverse: a pass without options as its bare name."""
    return [name if not options else (name, options) for name, options in steps]


def run_pipeline(
    program: Program,
    pipeline: Sequence[PassSpec],
    *,
    verify: bool = False,
    dump_dir: str | Path | None = None,
) -> Program:
    """Apply the passes in order. With `verify`, each pass's output program is run against its input
    program on the same random inputs and must agree within the pass's tolerance. With `dump_dir`,
    the graph's code is written there before the first pass and after each pass."""
    steps = pass_steps(pipeline)
    for name, _ in steps:
        if name not in PASSES:
            raise PassError(f"unknown pass {name!r} (registered: {', '.join(PASSES)})")
    dump = Path(dump_dir) if dump_dir is not None else None
    if dump is not None:
        dump.mkdir(parents=True, exist_ok=True)
        (dump / "00-captured.py").write_text(program.graph_module.code, encoding="utf-8")
    for index, (name, options) in enumerate(steps, start=1):
        program = _run_one(program, name, options, verify)
        if dump is not None:
            (dump / f"{index:02d}-{name}.py").write_text(program.graph_module.code, encoding="utf-8")
    return program


def _run_one(program: Program, name: str, options: dict[str, Any], verify: bool) -> Program:
    p = PASSES[name]
    before = program.graph_stats()
    history = list(program.history)
    # A past in the cache only when the program before the pass already has a KV cache (one with only a recurrent
    # state, before kv_cache, still attends over its new tokens alone).
    has_kv = any(cache_layer(name) is not None for name in program.input_names)
    past_max = VERIFY_CONTEXT - VERIFY_TOKENS if has_kv else 0
    check = p.verification or Verification()
    if verify:
        before_inputs = check.inputs(program, options) if check.inputs else _verify_inputs(program, past_max)
        reference = check.reference(program, before_inputs, options) if check.reference else program(**before_inputs)
    with stage(f"pass {name}") as shown:
        started = time.perf_counter()
        program, pass_stats = p.run(program, **options)
        seconds = time.perf_counter() - started
        after = program.graph_stats()
        max_error = None
        if verify:
            if check.run:
                inputs, result = before_inputs, check.run(program, before_inputs, options)
            elif check.inputs or check.reference:  # the same inputs (those the program still takes)
                inputs, result = before_inputs, program(**before_inputs)
            else:
                inputs = _verify_inputs(program, past_max)
                result = program(**inputs)
            # a layout-changing check (run) returns slot outputs
            paged = program.kv_layout is KVLayout.PAGED and not check.run
            lens = inputs.get(INPUT_LENS)
            max_error = _compare(reference, result, lens, paged, p.tolerance_for(options), name)
        stats = {**pass_stats, **{f"{k}_before": v for k, v in before.items()}, **after}
        shown.detail = ", ".join(f"{k}={v}" for k, v in pass_stats.items()) + (
            f", verified (max error {max_error:.2e})" if verify else ""
        )
    program.history = [*history, PassRecord(name, dict(options), stats, seconds, max_error)]
    return program


def _verify_inputs(program: Program, past_max: int) -> dict[str, torch.Tensor]:
    if program.kv_layout is KVLayout.PAGED:
        blocks = -(-VERIFY_CONTEXT // program.block_size)
        tokens = VERIFY_BATCH * VERIFY_TOKENS
        return paged_example_inputs(program, VERIFY_BATCH, tokens, blocks, 4 * blocks, past_max=past_max, seed=1234)
    return example_inputs(program, VERIFY_BATCH, VERIFY_TOKENS, VERIFY_CONTEXT, past_max=past_max, seed=1234)


def _compare(
    reference: dict[str, torch.Tensor],
    result: dict[str, torch.Tensor],
    input_lens: torch.Tensor | None,
    paged: bool,
    tolerance: float,
    name: str,
) -> float:
    """Largest error over the outputs both programs have, relative to the reference's magnitude; logits
    only at real (non-padding) positions (`paged`: tokens packed in one row, no padding)."""
    worst = 0.0
    for key in reference.keys() & result.keys():
        expected, actual = reference[key].float(), result[key].float()
        if key == LOGITS and actual.shape[1] == 1 < expected.shape[1]:  # last-token logits vs every position
            if paged:
                expected = expected[0, torch.cumsum(input_lens, 0) - 1][:, None]
            else:
                expected = expected[torch.arange(expected.shape[0]), input_lens - 1][:, None]
        elif key == LOGITS and input_lens is not None and not paged:
            valid = torch.arange(expected.shape[1])[None, :] < input_lens[:, None]
            expected, actual = expected[valid], actual[valid]
        error = float((expected - actual).abs().max()) / max(1.0, float(expected.abs().max()))
        worst = max(worst, error)
    if worst > tolerance:
        raise PassError(f"pass {name} changed the program's outputs: relative error {worst:.3e} > {tolerance:.0e}")
    return worst
