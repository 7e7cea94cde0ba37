"""`moe_experts`: the routed experts of a mixture-of-experts layer, given the router's choice.

Token t goes through experts expert_ids[t, j] (j < top_k), each a gated MLP, and the results are summed with
weights expert_weights[t, j]. The router itself (softmax/sigmoid, top-k, grouping, bias, normalisation) stays
in the graph as the model wrote it, so every routing scheme is captured without code of its own.

Weights, for E experts of intermediate size I over hidden size H (ONNX Runtime's MoE layout):
w_up [E, 2I, H] with gate and up rows interleaved (row 2i: gate i, row 2i + 1: up i), b_up [E, 2I] or None,
w_down [E, H, I], b_down [E, H] or None. The gate is a (clamped) SwiGLU: g' = min(g, limit),
u' = clamp(u, -limit, limit) (no clamp when limit is 0), act = g' * sigmoid(alpha g') * (u' + beta); SwiGLU is
alpha 1, beta 0, limit 0; gpt-oss's is alpha 1.702, beta 1, limit 7.
"""

from __future__ import annotations

import torch

from .registry import NAMESPACE, Cost, OpDef, register_op


def swiglu(gate_up: torch.Tensor, alpha: float, beta: float, limit: float) -> torch.Tensor:
    """The clamped SwiGLU of interleaved [..., 2I] gate/up values -> [..., I]."""
    gate, up = gate_up[..., 0::2], gate_up[..., 1::2]
    if limit > 0:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return gate * torch.sigmoid(alpha * gate) * (up + beta)


def moe_experts_reference(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    expert_weights: torch.Tensor,
    w_up: torch.Tensor,
    b_up: torch.Tensor | None,
    w_down: torch.Tensor,
    b_down: torch.Tensor | None,
    alpha: float = 1.0,
    beta: float = 0.0,
    limit: float = 0.0,
) -> torch.Tensor:
    """Every expert on every token, combined by a [tokens, experts] routing matrix that is zero where an expert
    was not chosen: no Python over data, so it traces (and MLIR gets it by decomposition). Lowerings compute
    only the chosen experts."""
    chosen = expert_ids[..., None] == torch.arange(w_up.shape[0], device=x.device)  # [tokens, top_k, experts]
    routing = (chosen.to(x.dtype) * expert_weights.to(x.dtype)[..., None]).sum(1)  # [tokens, experts]
    hidden = torch.einsum("th,euh->etu", x, w_up)  # [experts, tokens, 2I]
    if b_up is not None:
        hidden = hidden + b_up[:, None, :]
    out = torch.einsum("eti,ehi->eth", swiglu(hidden, alpha, beta, limit), w_down)  # [experts, tokens, H]
    if b_down is not None:
        out = out + b_down[:, None, :]
    return torch.einsum("te,eth->th", routing, out)


moe_experts = torch.library.custom_op(f"{NAMESPACE}::moe_experts", moe_experts_reference, mutates_args=())


@moe_experts.register_fake
def _moe_experts_fake(x, expert_ids, expert_weights, w_up, b_up, w_down, b_down, alpha=1.0, beta=0.0, limit=0.0):
    return torch.empty_like(x)


def experts_touched(tokens: int, top_k: int, experts: int) -> float:
    """Expected number of distinct experts `tokens` tokens choose, top_k each, under uniform routing: exactly
    top_k for one token, all of them for many."""
    if tokens * top_k >= 50 * experts:
        return float(experts)
    return experts * (1.0 - (1.0 - top_k / experts) ** tokens)


def moe_experts_cost(
    tokens: int, top_k: int, experts: int, hidden: int, intermediate: int, expert_bytes: int, element_bytes: int
) -> Cost:
    """Three matmuls (gate, up, down) per chosen (token, expert) pair plus the gate; the weights read are those
    of the distinct experts chosen (`expert_bytes` each: packed weights, scales, zeros and biases)."""
    pairs = tokens * top_k
    flops = pairs * (6 * hidden * intermediate + 6 * intermediate + 2 * hidden)
    weights = round(experts_touched(tokens, top_k, experts) * expert_bytes)
    activations = element_bytes * (2 * tokens * hidden + pairs * 3 * intermediate) + pairs * 12
    return Cost(flops=flops, bytes=weights + activations, weight_bytes=weights)


MOE_EXPERTS = register_op(
    OpDef(
        name="moe_experts",
        op=torch.ops.llmlower.moe_experts,
        summary="the routed experts of a MoE layer: gated MLPs of the chosen experts, weighted and summed",
        cost=moe_experts_cost,
        reference=moe_experts_reference,
    )
)
