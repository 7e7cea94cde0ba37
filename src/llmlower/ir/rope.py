"""`rope`: rotary position embedding, half-split (GPT-NeoX / transformers' rotate_half) layout.

rope(x, cos, sin) = x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x[..., d/2:], x[..., :d/2]).
x is [batch, heads, tokens, head_dim]; cos and sin broadcast to it ([batch, 1, tokens, head_dim] as
transformers computes them from the explicit position ids).
"""

from __future__ import annotations

import torch

from .registry import NAMESPACE, Cost, OpDef, register_op


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


rope = torch.library.custom_op(f"{NAMESPACE}::rope", rope_reference, mutates_args=())


@rope.register_fake
def _rope_fake(x, cos, sin):
    return torch.empty(torch.broadcast_shapes(x.shape, cos.shape), dtype=torch.promote_types(x.dtype, cos.dtype))


def rope_cost(elements: int, element_bytes: int) -> Cost:
    """Two multiplies and an add per element; reads x, writes the result (cos/sin are shared per token)."""
    return Cost(flops=3 * elements, bytes=2 * elements * element_bytes)


ROPE = register_op(
    OpDef("rope", torch.ops.llmlower.rope, "rotary embedding (rotate_half layout)", rope_cost, rope_reference)
)
