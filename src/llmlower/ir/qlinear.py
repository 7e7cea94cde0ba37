"""`qlinear` and `qembedding`: a linear layer / an embedding lookup over weights stored in a quant format
(see ir/quant.py). The reference implementations dequantize and run the float op; backends use fused
kernels (ONNX Runtime's MatMulNBits and GatherBlockQuantized, TVM's dequantize + matmul fusion)."""

from __future__ import annotations

import torch

from .quant import dequantize
from .registry import NAMESPACE, Cost, OpDef, register_op


def qlinear_reference(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    bias: torch.Tensor | None,
    bits: int,
    in_features: int,
) -> torch.Tensor:
    weight = dequantize(qweight, scales, zeros, bits, in_features).to(x.dtype)
    return torch.nn.functional.linear(x, weight, bias)


qlinear = torch.library.custom_op(f"{NAMESPACE}::qlinear", qlinear_reference, mutates_args=())


@qlinear.register_fake
def _qlinear_fake(x, qweight, scales, zeros, bias, bits, in_features):
    return x.new_empty((*x.shape[:-1], qweight.shape[0]))


def qembedding_reference(
    ids: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, bits: int, dim: int
) -> torch.Tensor:
    flat = ids.reshape(-1)
    rows = dequantize(qweight[flat], scales[flat], zeros[flat] if zeros is not None else None, bits, dim)
    return rows.to(scales.dtype).reshape(*ids.shape, dim)


qembedding = torch.library.custom_op(f"{NAMESPACE}::qembedding", qembedding_reference, mutates_args=())


@qembedding.register_fake
def _qembedding_fake(ids, qweight, scales, zeros, bits, dim):
    return scales.new_empty((*ids.shape, dim))


def qlinear_cost(rows: int, in_features: int, out_features: int, weight_bytes: int, element_bytes: int) -> Cost:
    """2 FLOPs per multiply-add; moves the packed weight (with scales and zeros) once, plus x and the output."""
    activations = element_bytes * rows * (in_features + out_features)
    return Cost(
        flops=2 * rows * in_features * out_features, bytes=weight_bytes + activations, weight_bytes=weight_bytes
    )


def qembedding_cost(rows: int, dim: int, bytes_per_row: int, element_bytes: int) -> Cost:
    """A gather: reads the packed rows, writes float rows."""
    return Cost(
        flops=2 * rows * dim, bytes=rows * (bytes_per_row + dim * element_bytes), weight_bytes=rows * bytes_per_row
    )


QLINEAR = register_op(
    OpDef("qlinear", torch.ops.llmlower.qlinear, "linear over int8/int4 weights", qlinear_cost, qlinear_reference)
)
QEMBEDDING = register_op(
    OpDef(
        "qembedding",
        torch.ops.llmlower.qembedding,
        "embedding lookup in an int8/int4 table",
        qembedding_cost,
        qembedding_reference,
    )
)
