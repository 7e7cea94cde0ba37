"""Concrete shapes of every node of a Program for one step, by running its graph on fake tensors."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode

from ..ir.program import INPUT_IDS, INPUT_LENS, PAST_LENS, POSITION_IDS, Program
from ..step_io import LOGITS_INDICES


@dataclass(frozen=True)
class Step:
    """One forward step: `batch` sequences, each bringing `tokens` new tokens after `past` cached ones."""

    phase: str
    batch: int
    tokens: int
    past: int

    @property
    def context(self) -> int:
        """Cache positions each sequence attends to (and the cache's length in the step's inputs)."""
        return self.past + self.tokens

    @property
    def label(self) -> str:
        if self.phase == "prefill":
            return f"prefill N={self.tokens}"
        return f"decode B={self.batch} C={self.context}"


def prefill_step(tokens: int) -> Step:
    """A prompt of `tokens` tokens for one sequence with an empty cache."""
    return Step("prefill", batch=1, tokens=tokens, past=0)


def decode_step(batch: int, context: int) -> Step:
    """One new token for each of `batch` sequences; with it, each attends to `context` cache positions."""
    return Step("decode", batch=batch, tokens=1, past=context - 1)


def step_inputs(program: Program, step: Step) -> list[torch.Tensor]:
    """The program's inputs for `step` (zeros; only shapes and dtypes matter), in signature order."""
    sizes = {"batch": step.batch, "tokens": step.tokens, "context": step.context}
    values = {
        INPUT_IDS: torch.zeros(step.batch, step.tokens, dtype=torch.int64),
        POSITION_IDS: step.past + torch.arange(step.tokens).repeat(step.batch, 1),
        PAST_LENS: torch.full((step.batch,), step.past, dtype=torch.int64),
        INPUT_LENS: torch.full((step.batch,), step.tokens, dtype=torch.int64),
        LOGITS_INDICES: torch.arange(1, step.batch + 1) * step.tokens - 1,  # each sequence's last token
    }
    inputs = []
    for t in program.inputs:
        if t.name in values:
            inputs.append(values[t.name])
        else:  # a cache: [batch, kv_heads, context, head_dim]
            shape = tuple(sizes[d] if isinstance(d, str) else d for d in t.shape)
            inputs.append(torch.empty(shape, dtype=getattr(torch, t.dtype)))
    return inputs


def propagate(program: Program, step: Step) -> dict[torch.fx.Node, Any]:
    """Every node's value (fake tensors: shapes and dtypes, no data) when the program runs `step`. The
    weights stay real tensors; nothing is computed."""
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        inputs = [mode.from_tensor(t) for t in step_inputs(program, step)]
        interpreter = torch.fx.Interpreter(program.graph_module, garbage_collect_values=False)
        interpreter.run(*inputs)
    return interpreter.env
