"""Recurrent mixers that transformers computes in chunks, captured as one op each.

transformers' Gated DeltaNet layers (Qwen3-Next, Qwen3.5, OLMo's hybrid) call its torch implementations of the
delta rule, `torch_chunk_gated_delta_rule` and `torch_recurrent_gated_delta_rule`, its Mamba-2 layers
(Granite-4.0-H, Nemotron-H, Falcon-H1, Bamba, Zamba2) `mamba2_chunk_scan` and its Mamba layers (Jamba, Mamba,
Falcon-Mamba) `mamba_selective_scan`: the fallbacks of its kernel interface, named alike in every family, whose
loops over chunks or tokens (or padding to whole chunks) torch.export cannot keep dynamic. While a model is captured
those functions, in every modeling module of the model, record `gated_delta_rule`, `ssd_scan` or `selective_scan`
instead; afterwards they are transformers' own again.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import torch

from ..errors import CaptureError
from ..ir.gated_delta_rule import GATED_DELTA_RULE
from ..ir.selective_scan import SELECTIVE_SCAN
from ..ir.ssd_scan import SSD_SCAN
from .attention_capture import NEUTRAL, PASSED_ON

DELTA_RULE_FUNCTIONS = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")
SSD_FUNCTIONS = ("mamba2_chunk_scan",)
SELECTIVE_SCAN_FUNCTIONS = ("mamba_selective_scan",)


def _refuse_extras(what: str, kwargs: dict[str, Any], ignored: tuple[str, ...]) -> None:
    """Refuse, naming them, keywords that would change what the captured op computes."""
    given = {
        name: value
        for name, value in kwargs.items()
        if value is not None and name not in ignored and (name not in NEUTRAL or value != NEUTRAL[name])
    }
    if given:
        raise CaptureError(f"{what}: keywords {sorted(given)} have no counterpart in llmlower's op")


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
    if initial_state is not None:
        raise CaptureError("gated delta rule: capture has no recurrent state to start from")
    _refuse_extras("gated delta rule", kwargs, ("chunk_size",))
    return GATED_DELTA_RULE.op(query, key, value, g, beta, bool(use_qk_l2norm_in_kernel)), None


def captured_ssd_scan(
    hidden_states: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    D: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    initial_states: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    return_final_states: bool = False,
    **kwargs: Any,
) -> torch.Tensor:
    """transformers' Mamba-2 chunked scan as one `ssd_scan` over the whole prompt (no initial or final state)."""
    if initial_states is not None or return_final_states:
        raise CaptureError("mamba2 scan: capture has no recurrent state to start from or return")
    _refuse_extras("mamba2 scan", kwargs, tuple(PASSED_ON))
    low, high = (float(limit) for limit in dt_limit)
    return SSD_SCAN.op(hidden_states, dt, A, B, C, D, dt_bias, bool(dt_softplus), low, high)


def captured_selective_scan(
    hidden_states: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    delta_bias: torch.Tensor | None = None,
    delta_softplus: bool = False,
    return_last_state: bool = False,
    **kwargs: Any,
) -> torch.Tensor:
    """transformers' Mamba selective scan as one `selective_scan` over the whole prompt (no final state; the
    choice of its torch algorithm changes nothing the op computes)."""
    if return_last_state:
        raise CaptureError("mamba selective scan: capture has no recurrent state to return")
    _refuse_extras("mamba selective scan", kwargs, ("use_mambapy", "use_associative_scan", *PASSED_ON))
    return SELECTIVE_SCAN.op(hidden_states, dt, A, B, C, D, z, delta_bias, bool(delta_softplus))


@contextlib.contextmanager
def recurrent_capture(module: torch.nn.Module) -> Iterator[None]:
    """While the block runs, the recurrences of `module`'s modeling modules record one op each."""
    modules = {sys.modules[type(m).__module__] for m in module.modules()}
    captured = (
        dict.fromkeys(DELTA_RULE_FUNCTIONS, captured_delta_rule)
        | dict.fromkeys(SSD_FUNCTIONS, captured_ssd_scan)
        | dict.fromkeys(SELECTIVE_SCAN_FUNCTIONS, captured_selective_scan)
    )
    saved = [(mod, name, getattr(mod, name)) for mod in modules for name in captured if hasattr(mod, name)]
    try:
        for mod, name, _ in saved:
            setattr(mod, name, captured[name])
        yield
    finally:
        for mod, name, function in saved:
            setattr(mod, name, function)
