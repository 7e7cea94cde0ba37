"""The recurrent ops in the PAGED layout: `paged_<op>` for each stateful step op (causal_conv1d, gated_delta_step,
selective_step, ssd_step).

A PAGED step packs its sequences' new tokens in one row ([1, tokens], input_lens[b] of them for sequence b, one
after another), and each recurrent state is a pool of rows [state slots, ...] like the KV pools: sequence b's state
is row state_slots[b]. `paged_<op>` takes the step op's arguments with the pool in the state's place followed by
`state_slots`; it returns the step op's output for the packed tokens and the pool with the step's rows updated (a
backend updates them in place, as the paged attention ops do the KV pools). Its reference unpacks the tokens into
right-padded rows, runs the step op's reference on the slots' states and packs the output back: one definition of
the math, the step op's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .causal_conv import CAUSAL_CONV1D
from .gated_delta_rule import GATED_DELTA_STEP
from .registry import NAMESPACE, OpDef, register_op
from .selective_scan import SELECTIVE_STEP
from .ssd_scan import SSD_STEP

_LIBRARY = torch.library.Library(NAMESPACE, "FRAGMENT")


@dataclass(frozen=True)
class PackedTokens:
    """Where a step op keeps its tokens: argument index -> that argument's token dimension, and its output's."""

    inputs: dict[int, int]
    output: int


def _padded(x: torch.Tensor, dim: int, index: torch.Tensor) -> torch.Tensor:
    """[1, .., tokens at dim, ..] -> [seqs, .., width at dim, ..]: row b's tokens at `index` [seqs, width]."""
    rows = x[0].movedim(dim - 1, 0)[index]  # [seqs, width, ...]
    return rows.movedim(1, dim)


def _packed(y: torch.Tensor, dim: int, valid: torch.Tensor) -> torch.Tensor:
    """[seqs, .., width at dim, ..] -> [1, .., tokens at dim, ..]: the `valid` [seqs, width] positions in order."""
    return y.movedim(dim, 1)[valid].unsqueeze(0).movedim(1, dim)


def _paged_reference(step: OpDef, state_at: int, tokens: PackedTokens) -> Callable[..., Any]:
    def reference(*args: Any) -> tuple[torch.Tensor, torch.Tensor]:
        args = list(args)
        pool, slots = args[state_at], args.pop(state_at + 1)
        input_lens = args[state_at + 2]
        width = int(input_lens.max())
        starts = torch.cumsum(input_lens, 0) - input_lens
        positions = torch.arange(width)[None, :]
        valid = positions < input_lens[:, None]
        index = torch.minimum(starts[:, None] + positions, (starts + input_lens - 1)[:, None])
        for at, dim in tokens.inputs.items():
            if args[at] is not None:
                args[at] = _padded(args[at], dim, index)
        args[state_at] = pool[slots]
        out, state = step.overload(*args)
        return _packed(out, tokens.output, valid), pool.index_copy(0, slots, state.to(pool.dtype))

    return reference


def _paged_fake(step: OpDef, state_at: int) -> Callable[..., Any]:
    def fake(*args: Any) -> tuple[torch.Tensor, torch.Tensor]:
        args = list(args)
        args.pop(state_at + 1)
        return step.overload(*args)  # the step op's fake: its output for the packed tokens, and the pool's shape

    return fake


def _schema(step: OpDef) -> str:
    """The step op's schema with `Tensor state_slots` after its state."""
    text = str(step.overload._schema)
    arguments = text[text.index("(") + 1 : text.index(") ->")].split(", ")
    arguments.insert(arguments.index("Tensor state") + 1, "Tensor state_slots")
    return f"({', '.join(arguments)}) -> (Tensor, Tensor)"


def register_paged(step: OpDef, tokens: PackedTokens) -> OpDef:
    """Define and register `paged_<step>` (see the module docstring)."""
    name = f"paged_{step.name}"
    _LIBRARY.define(name + _schema(step))
    state_at = [a.name for a in step.overload._schema.arguments].index("state")
    _LIBRARY.impl(name, _paged_reference(step, state_at, tokens), "CompositeExplicitAutograd")
    torch.library.register_fake(f"{NAMESPACE}::{name}", _paged_fake(step, state_at), lib=_LIBRARY)
    return register_op(
        OpDef(name, getattr(torch.ops.llmlower, name), f"{step.summary}; tokens packed, states in a pool", step.cost)
    )


PAGED_CAUSAL_CONV1D = register_paged(CAUSAL_CONV1D, PackedTokens({0: 2}, 2))
PAGED_GATED_DELTA_STEP = register_paged(GATED_DELTA_STEP, PackedTokens(dict.fromkeys(range(5), 1), 1))
PAGED_SELECTIVE_STEP = register_paged(SELECTIVE_STEP, PackedTokens(dict.fromkeys((0, 1, 3, 4, 6), 2), 2))
PAGED_SSD_STEP = register_paged(SSD_STEP, PackedTokens(dict.fromkeys((0, 1, 3, 4), 1), 1))
# the step op each paged op replaces
PAGED_RECURRENT = {
    op.overload: paged.overload
    for op, paged in (
        (CAUSAL_CONV1D, PAGED_CAUSAL_CONV1D),
        (GATED_DELTA_STEP, PAGED_GATED_DELTA_STEP),
        (SELECTIVE_STEP, PAGED_SELECTIVE_STEP),
        (SSD_STEP, PAGED_SSD_STEP),
    )
}
