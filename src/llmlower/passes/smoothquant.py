"""smoothquant: move the activations' outlier channels into the weights of linears whose activations are
quantized per row.

The ONNX backend multiplies an int8 weight with one scale per output channel (q8c) in integers: each activation
row is rounded to int8 with one scale, so a few large channels (the inputs of q/k/v and down carry some) leave the
others a handful of steps. Per-input-channel scales s = max|x|^alpha / max|w|^(1 - alpha), folded into the op before
the group (passes/channel_scales.py), flatten the activation and move its range into the weight, which has a scale
per output channel to spare. alpha per group minimizes the error of the group's outputs with both the weights and
the activation rows rounded as the kernel rounds them, on calibration tokens. SmolLM2 (q4mix-a8, ONNX artifacts,
tests/data/perplexity.txt): q/k/v and down in q8c give 27.05 unsmoothed, 26.61 smoothed (fp32 25.48).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..errors import PassError
from ..ir.program import Program
from ..ir.quant import QuantScheme
from .channel_scales import scale_channels
from .quantize_weights import QuantPlan, quant_plan
from .registry import Pass, register_pass


def rounds_rows(scheme: QuantScheme | None) -> bool:
    """int8 with one scale per output channel: the weights whose activations the ONNX backend rounds per row."""
    return scheme is not None and scheme.bits == 8 and scheme.group == 0


def smooths(plan: QuantPlan) -> bool:
    """Whether `plan` gives a linear other than the LM head per-channel int8: the pipelines this pass belongs in."""
    return any(rounds_rows(scheme) for scheme in (plan.scheme, *(s for _, s in plan.special)))


class Smoothing:
    """SmoothQuant: groups of per-channel int8 weights; s = max|x|^alpha / max|w|^(1 - alpha); the kernel sees
    each activation row rounded to int8 (symmetric, one scale a row, as backends/onnx/lowerings rounds it)."""

    def takes(self, schemes: list[QuantScheme]) -> bool:
        return all(rounds_rows(scheme) for scheme in schemes)

    def scales(self, rows: torch.Tensor, weights: list[torch.Tensor], alpha: float) -> torch.Tensor:
        peak_w = torch.stack([w.abs().amax(dim=0) for w in weights]).amax(dim=0).clamp(min=1e-6)
        return rows.abs().amax(dim=0).clamp(min=1e-6) ** alpha / peak_w ** (1 - alpha)

    def seen(self, rows: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
        step = (rows.abs().amax(dim=1, keepdim=True) / 127).clamp(min=1e-30)
        return torch.round(rows / step) * step


def smoothquant(
    program: Program, calibration: Sequence[int] = (), quant: dict[str, Any] | None = None
) -> tuple[Program, dict]:
    if len(calibration) < 2:
        raise PassError("smoothquant: calibration needs at least two token ids")
    plan = quant_plan("smoothquant", quant)
    if not smooths(plan):
        raise PassError("smoothquant: quant needs quantize_weights' options with per-channel int8 weights (q8c)")
    return program, scale_channels(program, calibration, plan, Smoothing(), "smoothquant")


register_pass(
    Pass(
        name="smoothquant",
        summary="activation outliers moved into per-channel int8 weights (folded into norms / up projections)",
        explain=(
            "For each group of per-channel int8 linears (q8c, whose activations the ONNX backend rounds to int8 "
            "per row) that read one activation, multiplies the weights by per-input-channel scales "
            "max|x|^alpha / max|w|^(1 - alpha) and divides the producer of that activation by them: the same "
            "float program, whose activation rows round with less error. alpha per group minimizes the outputs' "
            "error with weights and activations rounded, on calibration tokens (filled in by the compile). "
            "Options: quant (quantize_weights' options, which must follow), calibration."
        ),
        run=smoothquant,
        tolerance=1e-4,
        calibrated=True,
    )
)
