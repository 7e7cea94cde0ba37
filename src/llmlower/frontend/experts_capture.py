"""Capture a mixture-of-experts layer's routed experts as one `moe_experts` op.

transformers dispatches every fused experts module (`@use_experts_implementation`) through its experts
interface; registering the implementation "llmlower" there makes each such module call `moe_experts` with its
weights in the op's layout. What the model computes around it (router, shared experts) stays aten ops. The
module's gate function is identified by running it on probe values, so an unknown gate is refused, never
captured wrong.
"""

from __future__ import annotations

import torch
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

from ..errors import CaptureError
from ..ir.moe import MOE_EXPERTS, swiglu

EXPERTS_IMPLEMENTATION = "llmlower"


def _interleaved(weight: torch.Tensor, concatenated: bool) -> torch.Tensor:
    """[E, 2I, ...] gate/up rows in the op's interleaved order (gate i at 2i, up i at 2i + 1)."""
    if not concatenated:
        return weight
    experts, rows = weight.shape[:2]
    halves = weight.reshape(experts, 2, rows // 2, *weight.shape[2:])
    return halves.transpose(1, 2).reshape(weight.shape)


def _linear_layout(weight: torch.Tensor, transposed: bool) -> torch.Tensor:
    """[E, out, in] from a module's [E, out, in] or, transposed, [E, in, out] weights."""
    return weight.transpose(1, 2) if transposed else weight


def gate_parameters(module: torch.nn.Module) -> tuple[float, float, float]:
    """(alpha, beta, limit) of the clamped SwiGLU that the module's gate computes, found by comparing its
    `_apply_gate` with each candidate on probe values large enough to reach a clamp."""
    intermediate = 8
    probe = torch.randn(4, 2 * intermediate, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 12
    with torch.no_grad():
        expected = module._apply_gate(probe.to(_dtype(module))).double()
    interleaved = _interleaved(probe.T[None], module.is_concatenated)[0].T  # rows as the op's weights hold them
    alpha = float(getattr(module, "alpha", 1.0))
    limit = float(getattr(module, "limit", None) or 0.0)
    for candidate in ((1.0, 0.0, 0.0), (alpha, 1.0, limit), (alpha, 0.0, limit)):
        if torch.allclose(swiglu(interleaved, *candidate), expected, rtol=1e-3, atol=1e-3):
            return candidate
    raise CaptureError(
        f"{type(module).__name__}: its experts' gate function is not a (clamped) SwiGLU, the only gate the "
        "moe_experts op has"
    )


def _dtype(module: torch.nn.Module) -> torch.dtype:
    return next(module.parameters()).dtype


def _check(module: torch.nn.Module) -> None:
    name = type(module).__name__
    if not module.has_gate:
        raise CaptureError(f"{name}: experts without a gate (up projection alone) have no moe_experts lowering")
    if module.has_post_expert_norm:
        raise CaptureError(f"{name}: a norm after each expert has no moe_experts lowering")
    if getattr(module, "_is_expert_parallel", False):
        raise CaptureError(f"{name}: expert-parallel modules cannot be captured")


def prepare_experts(model: torch.nn.Module) -> int:
    """Check every experts module of `model` and record its gate's parameters (found eagerly here: the probe
    cannot run inside torch.export); returns how many there are."""
    modules = [m for m in model.modules() if hasattr(m, "_apply_gate") and hasattr(m, "gate_up_proj")]
    for module in modules:
        _check(module)
        module.llmlower_gate = gate_parameters(module)
    return len(modules)


def llmlower_experts_forward(
    module: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """The experts interface's entry point: one moe_experts call with the module's weights in the op's layout."""
    alpha, beta, limit = module.llmlower_gate
    concatenated, transposed = module.is_concatenated, module.is_transposed
    w_up = _interleaved(_linear_layout(module.gate_up_proj, transposed), concatenated)
    w_down = _linear_layout(module.down_proj, transposed)
    b_up = _interleaved(module.gate_up_proj_bias, concatenated) if module.has_bias else None
    b_down = module.down_proj_bias if module.has_bias else None
    return MOE_EXPERTS.op(
        hidden_states, top_k_index.long(), top_k_weights, w_up, b_up, w_down, b_down, alpha, beta, limit
    )


ALL_EXPERTS_FUNCTIONS.register(EXPERTS_IMPLEMENTATION, llmlower_experts_forward)
