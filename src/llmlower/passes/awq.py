"""awq: activation-aware scaling of int4 weights before they are quantized.

Each group of int4 linears that read one activation gets per-input-channel scales s = mean|x|^alpha folded into
the op before it (passes/channel_scales.py): the same float program, whose channels that carry the largest
activations take finer steps of the int4 grid. alpha per group minimizes the quantized outputs' error on
calibration tokens, each weight quantized with the scheme quantize_weights (the next pass, given the same options)
gives it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..errors import PassError
from ..ir.program import Program
from ..ir.quant import QuantScheme
from .channel_scales import scale_channels
from .quantize_weights import quant_plan
from .registry import Pass, register_pass


class ActivationAware:
    """AWQ: groups with an int4 weight; s = mean|x|^alpha; the kernel sees the activations as they are (its
    8-bit blocks of 32 round them finely)."""

    def takes(self, schemes: list[QuantScheme]) -> bool:
        return any(scheme.bits == 4 for scheme in schemes)

    def scales(self, rows: torch.Tensor, weights: list[torch.Tensor], alpha: float) -> torch.Tensor:
        return rows.abs().mean(dim=0).clamp(min=1e-6) ** alpha

    def seen(self, rows: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
        return rows


def awq(program: Program, calibration: Sequence[int] = (), quant: dict[str, Any] | None = None) -> tuple[Program, dict]:
    if len(calibration) < 2:
        raise PassError("awq: calibration needs at least two token ids")
    if not quant or (quant.get("bits", 4) != 4 and not quant.get("overrides")):
        raise PassError("awq: quant needs quantize_weights' options with int4 weights (e.g. --quant q4g32-sym)")
    return program, scale_channels(program, calibration, quant_plan("awq", quant), ActivationAware(), "awq")


register_pass(
    Pass(
        name="awq",
        summary="activation-aware weight scales before int4 (folded into norms / up projections)",
        explain=(
            "Multiplies the weights of each group of int4 linears that read one activation by per-input-channel "
            "scales mean|x|^alpha and divides the producer of that activation by them (a norm's weight, the up "
            "rows of a gate/up projection): the same float program, whose salient channels quantize more "
            "finely. alpha per group minimizes the quantized outputs' error on calibration tokens (filled in by "
            "the compile from its calibration text). Options: quant (quantize_weights' options, which must "
            "follow), calibration."
        ),
        run=awq,
        tolerance=1e-4,
        calibrated=True,
    )
)
