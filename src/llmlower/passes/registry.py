"""The pass registry: every pass is one module that registers a Pass under its name."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..ir.program import Program

Tensors = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Verification:
    """How --verify compares a pass whose program is not checked by running both programs on the same random
    inputs. A pass that changes what the program's inputs mean (e.g. the KV layout) gives `inputs`, which builds
    inputs for the program before the pass, and `run`, which runs the program after the pass on the same
    computation and returns its outputs as the program before would name and shape them. A pass that changes
    what the program computes on purpose (e.g. draft_layers' early exit) gives `reference`: the outputs expected
    of the program after the pass, computed from the program before it (before the pass runs) on the inputs.
    Each one left out is the default: random inputs, the program run as it is."""

    inputs: Callable[[Program, dict[str, Any]], Tensors] | None = None
    run: Callable[[Program, Tensors, dict[str, Any]], Tensors] | None = None
    reference: Callable[[Program, Tensors, dict[str, Any]], Tensors] | None = None


@dataclass(frozen=True)
class Pass:
    """A named Program -> Program rewrite.

    `run(program, **options)` returns the rewritten program and a dict of pass-specific stats (e.g. the
    number of pattern matches). `tolerance` bounds verification's relative error for this pass: a number,
    or a function of the pass's options (quantization depends on the bit width). `verification` replaces the
    default check (both programs on the same random inputs) where the inputs' meaning changes. A `calibrated`
    pass runs the program on real text: the compile fills its `calibration` option (token ids of
    frontend.calibration's text) when the pipeline leaves it out.
    """

    name: str
    summary: str
    explain: str
    run: Callable[..., tuple[Program, dict[str, Any]]]
    tolerance: float | Callable[[dict[str, Any]], float] = 1e-5
    verification: Verification | None = None
    calibrated: bool = False

    def tolerance_for(self, options: dict[str, Any]) -> float:
        return self.tolerance(options) if callable(self.tolerance) else self.tolerance


PASSES: dict[str, Pass] = {}


def register_pass(p: Pass) -> Pass:
    if p.name in PASSES:
        raise ValueError(f"pass {p.name!r} is already registered")
    PASSES[p.name] = p
    return p
