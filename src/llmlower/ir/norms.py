"""`rms_norm` and `add_rms_norm`: RMSNorm, alone or fused with the residual add that precedes it.

rms_norm(x, weight, eps) = (x * rsqrt(mean(x², last dim) + eps)) * weight, the statistics in float32 and
the normalised value cast back to x's dtype before the weight multiplies it (transformers' Llama order).
add_rms_norm(x, residual, weight, eps) = (rms_norm(x + residual), x + residual): the sum is returned
too because the next residual add reads it (ONNX Runtime's SkipSimplifiedLayerNormalization).
"""

from __future__ import annotations

import torch

from .registry import NAMESPACE, Cost, OpDef, register_op


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


rms_norm = torch.library.custom_op(f"{NAMESPACE}::rms_norm", rms_norm_reference, mutates_args=())


@rms_norm.register_fake
def _rms_norm_fake(x, weight, eps):
    return torch.empty(torch.broadcast_shapes(x.shape, weight.shape), dtype=torch.promote_types(x.dtype, weight.dtype))


def add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    total = x + residual
    return rms_norm_reference(total, weight, eps), total


add_rms_norm = torch.library.custom_op(f"{NAMESPACE}::add_rms_norm", add_rms_norm_reference, mutates_args=())


@add_rms_norm.register_fake
def _add_rms_norm_fake(x, residual, weight, eps):
    total = torch.empty(
        torch.broadcast_shapes(x.shape, residual.shape), dtype=torch.promote_types(x.dtype, residual.dtype)
    )
    return _rms_norm_fake(total, weight, eps), total


def rms_norm_cost(rows: int, hidden: int, element_bytes: int, residual: bool = False) -> Cost:
    """Square, sum, rsqrt, scale, weight (+ the add): a few FLOPs per element; reads x (and the residual),
    writes the output (and the sum)."""
    elements = rows * hidden
    tensors = 4 if residual else 2
    return Cost(
        flops=(5 if residual else 4) * elements,
        bytes=element_bytes * (tensors * elements + hidden),
        weight_bytes=element_bytes * hidden,
    )


RMS_NORM = register_op(
    OpDef("rms_norm", torch.ops.llmlower.rms_norm, "RMSNorm over the last dim", rms_norm_cost, rms_norm_reference)
)
ADD_RMS_NORM = register_op(
    OpDef(
        "add_rms_norm",
        torch.ops.llmlower.add_rms_norm,
        "residual add + RMSNorm; returns (normed, sum)",
        lambda rows, hidden, element_bytes: rms_norm_cost(rows, hidden, element_bytes, residual=True),
        add_rms_norm_reference,
    )
)
