"""`silu_mul`: SwiGLU on a fused gate/up projection: silu(x[..., :n]) * x[..., n:], n = last dim / 2."""

from __future__ import annotations

import torch

from .registry import NAMESPACE, Cost, OpDef, register_op


def silu_mul_reference(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


silu_mul = torch.library.custom_op(f"{NAMESPACE}::silu_mul", silu_mul_reference, mutates_args=())


@silu_mul.register_fake
def _silu_mul_fake(x):
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


def silu_mul_cost(rows: int, intermediate: int, element_bytes: int) -> Cost:
    """sigmoid, two multiplies per output element; reads gate and up, writes the product."""
    elements = rows * intermediate
    return Cost(flops=5 * elements, bytes=3 * elements * element_bytes)


SILU_MUL = register_op(
    OpDef("silu_mul", torch.ops.llmlower.silu_mul, "SwiGLU on [gate | up]", silu_mul_cost, silu_mul_reference)
)
