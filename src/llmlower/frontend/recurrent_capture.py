"""Recurrent mixers that transformers computes with Python loops over chunks or tokens, captured as one op each.

transformers' Gated DeltaNet layers (Qwen3-Next, Qwen3.5, OLMo's hybrid) call its torch implementations of the
delta rule, `torch_chunk_gated_delta_rule` and `torch_recurrent_gated_delta_rule` (the fallbacks of its kernel
interface, whatever the family), whose loops over a prompt's chunks torch.export cannot keep dynamic. While a model
is captured those functions, in every modeling module of the model, record `gated_delta_rule` instead; afterwards
they are transformers' own again.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import torch

from ..errors import CaptureError
from ..ir.gated_delta_rule import GATED_DELTA_RULE
from .attention_capture import NEUTRAL

DELTA_RULE_FUNCTIONS = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")


def captured_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' delta-rule signature as one `gated_delta_rule` over the whole prompt (the capture has no cache:
    no initial state, no final one; chunk_size changes nothing the op computes)."""
    given = {
        name: value
        for name, value in kwargs.items()
        if value is not None and name != "chunk_size" and (name not in NEUTRAL or value != NEUTRAL[name])
    }
    if initial_state is not None or given:
        raise CaptureError(f"gated delta rule: capture has no recurrent state to start from ({sorted(given)})")
    return GATED_DELTA_RULE.op(query, key, value, g, beta, bool(use_qk_l2norm_in_kernel)), None


@contextlib.contextmanager
def recurrent_capture(module: torch.nn.Module) -> Iterator[None]:
    """While the block runs, the delta-rule functions of `module`'s modeling modules record `gated_delta_rule`."""
    modules = {sys.modules[type(m).__module__] for m in module.modules()}
    saved = [(mod, name, getattr(mod, name)) for mod in modules for name in DELTA_RULE_FUNCTIONS if hasattr(mod, name)]
    try:
        for mod, name, _ in saved:
            setattr(mod, name, captured_delta_rule)
        yield
    finally:
        for mod, name, function in saved:
            setattr(mod, name, function)
