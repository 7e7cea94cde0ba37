"""gptq: quantize_weights with each linear's rounding chosen against its inputs (GPTQ) instead of to the nearest step.

The program runs once on calibration tokens (the LM head on every one). At each linear it reaches, the inputs X
give H = X^T X; the weight's columns are rounded one at a time, those of the inputs with the most energy (H's
diagonal) first, each column's rounding error pushed onto the columns not yet rounded through the inverse of H (so
that X W^T moves least, not W); each group keeps the scale and zero point quantize_weights gives it. The linear then
computes with its rounded weight, so later linears see the inputs the quantized model will give them. The stored
formats, schemes and options are quantize_weights' (MoE experts and embeddings are rounded to nearest as there).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.fx

from ..errors import PassError
from ..ir.program import Program, fetch_attr
from ..ir.quant import QuantizedWeight, QuantScheme, dequantize, pack, quantize, zero_points
from .calibration_store import remembered
from .kv_cache_dtype import calibration_inputs
from .quantize_weights import (
    WeightKey,
    as_linear,
    linear_schemes,
    quant_plan,
    quantized_tolerance,
    replace_weights,
    weight_key,
)
from .registry import Pass, register_pass

DAMPING = 1.0  # added to H's diagonal, as a share of its mean: H from a few hundred calibration tokens fits them,
# not text; SmolLM2 at q4g32-sym (perplexity.txt, 512 tokens): 31.43 at 0.01 (GPTQ's usual), 31.29 at 0.1, 30.90 at 1
BLOCK = 256  # columns rounded before their errors reach the rest in one matrix product (a multiple of every group)


def _inverse_factor(hessian: torch.Tensor) -> torch.Tensor:
    """The upper Cholesky factor of H^-1 (damped), whose rows carry a column's error to the columns after it."""
    diagonal = hessian.diagonal().mean()
    for damping in (DAMPING, 10 * DAMPING, 100 * DAMPING):
        damped = hessian + damping * diagonal * torch.eye(hessian.shape[0], dtype=hessian.dtype)
        lower, info = torch.linalg.cholesky_ex(damped)
        if not info:
            return torch.linalg.cholesky(torch.cholesky_inverse(lower), upper=True)
    raise PassError(f"gptq: the calibration inputs' Hessian is not positive definite with damping {damping}")


def gptq_quantize(weight: torch.Tensor, scheme: QuantScheme, hessian: torch.Tensor) -> QuantizedWeight:
    """A weight [N, K] in `scheme`'s stored form, rounded column by column against H = X^T X [K, K]: the columns
    of the inputs with the most energy first (H's diagonal), each group's scale and zero point those quantize
    gives it (so the order cannot leave a group's later columns outside its range)."""
    rows, in_features = weight.shape
    group = scheme.group or in_features
    blocks = -(-in_features // group)
    width = blocks * group
    w = torch.nn.functional.pad(weight.float(), (0, width - in_features))
    h = torch.eye(width)
    h[:in_features, :in_features] = hessian
    dead = h.diagonal() == 0  # inputs that were always zero: any rounding of their column is as good
    h[dead, dead] = 1
    w[:, dead] = 0
    nearest = quantize(w, scheme)
    scales, zeros = nearest.scales, zero_points(nearest.zeros, scheme.bits, nearest.scales)
    order = torch.argsort(h.diagonal(), descending=True)
    w, factor = w[:, order], _inverse_factor(h[order][:, order])
    codes = torch.empty(rows, width)
    low, high = (0, 15) if scheme.bits == 4 else (1, 255)
    for start in range(0, width, BLOCK):
        end = min(start + BLOCK, width)
        errors = torch.empty(rows, end - start)
        for column in range(start, end):
            block = int(order[column]) // group
            scale, zero = scales[:, block].float(), zeros[:, block]
            code = torch.clamp(torch.round(w[:, column] / scale + zero), low, high)
            codes[:, order[column]] = code
            error = (w[:, column] - (code - zero) * scale) / factor[column, column]
            w[:, column + 1 : end] -= error[:, None] * factor[column, column + 1 : end][None, :]
            errors[:, column - start] = error
        w[:, end:] -= errors @ factor[start:end, end:]
    return pack(codes.reshape(rows, blocks, group), scales, zeros, scheme, in_features)


class _Rounder(torch.fx.Interpreter):
    """Runs the program, rounding each planned linear's weight by GPTQ where it is reached and computing with the
    rounded weight from there on; keeps each rounded form and its output error against nearest rounding."""

    def __init__(self, gm: torch.fx.GraphModule, schemes: dict[torch.fx.Node, QuantScheme]) -> None:
        super().__init__(gm)
        self.schemes = schemes
        self.rounded: dict[WeightKey, QuantizedWeight] = {}
        self.error = {"gptq": 0.0, "nearest": 0.0}

    def run_node(self, node: torch.fx.Node) -> Any:
        scheme = self.schemes.get(node)
        if scheme is None:
            return super().run_node(node)
        args, kwargs = self.fetch_args_kwargs_from_env(node)
        transposed = as_linear(node)[3]
        x, at = (args[1], 2) if transposed else (args[0], 1)
        weight = args[at]
        key = weight_key(weight, scheme, transposed)
        rows = x.detach().reshape(-1, x.shape[-1]).float()
        hessian = rows.T @ rows
        if key not in self.rounded:
            float_weight = (weight.t() if transposed else weight).float()
            self.rounded[key] = gptq_quantize(float_weight, scheme, hessian)
            for name, packed in (("gptq", self.rounded[key]), ("nearest", quantize(float_weight, scheme))):
                delta = _dequantized(packed, scheme) - float_weight
                self.error[name] += float(((delta @ hessian) * delta).sum())
        rounded = _dequantized(self.rounded[key], scheme).to(weight.dtype)
        args = (*args[:at], rounded.t() if transposed else rounded, *args[at + 1 :])
        return node.target(*args, **kwargs)


def _dequantized(packed: QuantizedWeight, scheme: QuantScheme) -> torch.Tensor:
    return dequantize(packed.qweight, packed.scales, packed.zeros, scheme.bits, packed.in_features)


def gptq(program: Program, calibration: Sequence[int] = (), **options: Any) -> tuple[Program, dict[str, Any]]:
    """`options`: quantize_weights'; `calibration`: the token ids the inputs X come from. The rounded weights are
    kept in the calibration store (a compile with the same program, options and tokens reads them back)."""
    if len(calibration) < 2:
        raise PassError("gptq: calibration needs at least two token ids")
    plan = quant_plan("gptq", options)
    calibration = list(calibration)[: program.spec.max_positions]
    schemes = {node: scheme for node, scheme in linear_schemes(program, plan).items() if scheme is not None}
    keys = list(dict.fromkeys(_weight_key(program, node, scheme) for node, scheme in schemes.items()))

    def calibrate() -> dict[str, torch.Tensor]:
        rounder = _Rounder(program.graph_module, schemes)
        inputs = calibration_inputs(program, calibration, every_logit=True)  # the LM head sees every token
        with torch.no_grad():
            rounder.run(*(inputs[name] for name in program.input_names))
        tensors = {"error": torch.tensor([rounder.error["gptq"], rounder.error["nearest"]], dtype=torch.float64)}
        for index, key in enumerate(keys):
            packed = rounder.rounded[key]
            tensors |= {f"{index}.qweight": packed.qweight, f"{index}.scales": packed.scales}
            tensors[f"{index}.in_features"] = torch.tensor(packed.in_features)
            if packed.zeros is not None:
                tensors[f"{index}.zeros"] = packed.zeros
        return tensors

    tensors, cached = remembered("gptq", program, {**options, "calibration": calibration}, calibrate)
    rounded = {
        key: QuantizedWeight(
            tensors[f"{index}.qweight"],
            tensors[f"{index}.scales"],
            tensors.get(f"{index}.zeros"),
            int(tensors[f"{index}.in_features"]),
        )
        for index, key in enumerate(keys)
    }
    stats = replace_weights(program, plan, rounded)
    error, nearest = (float(value) for value in tensors["error"])
    return program, {
        **stats,
        "calibration_tokens": len(calibration),
        "calibration_cached": cached,
        "output_error_ratio": round(error / nearest, 4) if nearest else 1.0,
    }


def _weight_key(program: Program, linear: torch.fx.Node, scheme: QuantScheme) -> WeightKey:
    """The key _Rounder files a linear's rounded weight under."""
    _, weight, _, transposed = as_linear(linear)
    return weight_key(fetch_attr(program.graph_module, weight.target), scheme, transposed)


register_pass(
    Pass(
        name="gptq",
        summary="quantize_weights with GPTQ's rounding: each linear's output error on calibration tokens made small",
        explain=(
            "Does what quantize_weights does (same options, schemes and formats), but rounds each linear's "
            "weight column by column against the inputs it sees on calibration tokens (filled in by the compile "
            "from its calibration text), pushing each column's rounding error onto the columns still to be "
            "rounded through the inverse of X^T X, and runs the later layers on the rounded weights. Replaces "
            "quantize_weights in a pipeline. Stats: output_error_ratio (X-weighted error against nearest rounding)."
        ),
        run=gptq,
        tolerance=quantized_tolerance,
        calibrated=True,
    )
)
