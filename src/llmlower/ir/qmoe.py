"""`qmoe_experts`: `moe_experts` over quantized expert weights, what the quantize pass makes of it.

The experts' weights are in ir/quant.py's format, one quantized weight per expert stacked along a leading [E]
(ONNX Runtime's QMoE layout): up_qweight [E, 2I, blocks, bytes] (gate/up rows interleaved as in moe_experts),
up_scales [E, 2I, blocks], up_zeros None | float [E, 2I, blocks] | packed uint8 [E, 2I, ceil(blocks / 2)], and the
same for down [E, H, ...] over the intermediate size. Gate/up and down may have different bits and groups (q4mix).
The sizes are the tensors': hidden from x, intermediate from the up rows. The reference dequantizes and runs
moe_experts' reference (so MLIR gets it by decomposition); lowerings read only the chosen experts' packed bytes.
"""

from __future__ import annotations

import torch

from .moe import moe_experts_cost, moe_experts_reference
from .quant import dequantize
from .registry import NAMESPACE, OpDef, register_op


def qmoe_experts_reference(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    expert_weights: torch.Tensor,
    up_qweight: torch.Tensor,
    up_scales: torch.Tensor,
    up_zeros: torch.Tensor | None,
    b_up: torch.Tensor | None,
    up_bits: int,
    down_qweight: torch.Tensor,
    down_scales: torch.Tensor,
    down_zeros: torch.Tensor | None,
    b_down: torch.Tensor | None,
    down_bits: int,
    alpha: float = 1.0,
    beta: float = 0.0,
    limit: float = 0.0,
) -> torch.Tensor:
    """Every expert's weights dequantized, then moe_experts' reference."""
    hidden, intermediate = x.shape[-1], up_qweight.shape[1] // 2
    w_up = dequantize(up_qweight, up_scales, up_zeros, up_bits, hidden).to(x.dtype)
    w_down = dequantize(down_qweight, down_scales, down_zeros, down_bits, intermediate).to(x.dtype)
    return moe_experts_reference(x, expert_ids, expert_weights, w_up, b_up, w_down, b_down, alpha, beta, limit)


qmoe_experts = torch.library.custom_op(f"{NAMESPACE}::qmoe_experts", qmoe_experts_reference, mutates_args=())


@qmoe_experts.register_fake
def _qmoe_experts_fake(x, *_weights_and_gate):
    return torch.empty_like(x)


QMOE_EXPERTS = register_op(
    OpDef(
        name="qmoe_experts",
        op=torch.ops.llmlower.qmoe_experts,
        summary="moe_experts over int8/int4 expert weights (packed, scales, zero points per expert)",
        cost=moe_experts_cost,
        reference=qmoe_experts_reference,
    )
)
