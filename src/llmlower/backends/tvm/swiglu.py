"""The experts' gated activation as one expression: gate * sigmoid(alpha * gate) * (up + beta), both clamped to
`limit` first where it is > 0 (gpt-oss). The TE kernel applies it between the experts' matmuls; the int8 experts
kernel where it gathers the down matmul's rows of x."""

from __future__ import annotations

from tvm import tirx

Gate = tuple[float, float, float]  # alpha, beta, limit


def swiglu(gate: tirx.PrimExpr, value: tirx.PrimExpr, params: Gate) -> tirx.PrimExpr:
    """The activation of one gate/up pair (float32)."""
    alpha, beta, limit = params
    if limit > 0:
        gate, value = tirx.min(gate, limit), tirx.max(tirx.min(value, limit), -limit)
    return gate * tirx.sigmoid(gate * alpha) * (value + beta)
