"""Relax lowerings of a hybrid model's recurrent ops in the PAGED layout (ir/paged_recurrent.py): each is one call
of its CPU kernel (recurrent_kernels.py) that updates the state pool in place and returns the pool with the
op's output, as the paged attention converters return the KV pools."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
import torch.fx
from tvm import relax

from ...errors import LlmlowerError
from ...ir.paged_recurrent import PAGED_CAUSAL_CONV1D, PAGED_GATED_DELTA_STEP, PAGED_SELECTIVE_STEP, PAGED_SSD_STEP
from .recurrent_kernels import conv_kernel, delta_kernel, emit_paged_recurrence, selective_kernel, ssd_kernel

if TYPE_CHECKING:
    from .relax_import import StepImporter


def _step_inputs(importer: StepImporter, node: torch.fx.Node, slots: relax.Expr) -> tuple[relax.Expr, ...]:
    """(state_slots, past_lens, query_start) as the kernels take them (int32); refuses a non-CPU target."""
    if importer.target.kind.name != "llvm":
        raise LlmlowerError(
            f"the TVM backend cannot lower node {node.name} (op {node.target}): the recurrent ops have CPU kernels "
            "only; compile with --target cpu, or for the onnx backend"
        )
    _, past_lens, query_start = importer.kernel_inputs()
    return importer.block_builder.emit(relax.op.astype(slots, "int32")), past_lens, query_start


def _float32(importer: StepImporter, x: relax.Expr | None, size: int) -> relax.Expr:
    """x as float32, or zeros [size] where the model has none (a bias, D)."""
    if x is None:
        return relax.const(np.zeros(size, "float32"))
    return importer.block_builder.emit(relax.op.astype(x, "float32"))


def paged_causal_conv1d(node: torch.fx.Node, importer: StepImporter) -> relax.Expr:
    x, weight, bias, pool, slots = importer.retrieve_args(node)[:5]
    channels, width = (int(d) for d in weight.ty.shape)
    bias = relax.const(np.zeros(channels, str(x.ty.dtype))) if bias is None else bias
    kernel = conv_kernel(channels, width, str(x.ty.dtype), str(pool.ty.dtype))
    inputs = [x, weight, bias]
    step = _step_inputs(importer, node, slots)
    return emit_paged_recurrence(importer.block_builder, kernel, "paged_conv", pool, inputs, step, x.ty)


def paged_gated_delta_step(node: torch.fx.Node, importer: StepImporter) -> relax.Expr:
    q, k, v, g, beta, pool, slots, _, _, l2norm = importer.retrieve_args(node)
    key_heads, dk = int(q.ty.shape[2]), int(q.ty.shape[3])
    heads, dv = int(v.ty.shape[2]), int(v.ty.shape[3])
    kernel = delta_kernel(key_heads, heads, dk, dv, str(q.ty.dtype), bool(l2norm))
    out = relax.TensorType([1, v.ty.shape[1], heads, dv], str(q.ty.dtype))
    step = _step_inputs(importer, node, slots)
    return emit_paged_recurrence(importer.block_builder, kernel, "paged_delta", pool, [q, k, v, g, beta], step, out)


def paged_selective_step(node: torch.fx.Node, importer: StepImporter) -> relax.Expr:
    x, dt, A, B, C, D, z, dt_bias, pool, slots, _, _, softplus = importer.retrieve_args(node)
    channels, state_size = (int(d) for d in A.ty.shape)
    kernel = selective_kernel(channels, state_size, str(x.ty.dtype), z is not None, bool(softplus))
    floats = [_float32(importer, t, channels) for t in (A, D)]
    inputs = [x, dt, floats[0], B, C, floats[1], x if z is None else z, _float32(importer, dt_bias, channels)]
    step = _step_inputs(importer, node, slots)
    return emit_paged_recurrence(importer.block_builder, kernel, "paged_selective", pool, inputs, step, x.ty)


def paged_ssd_step(node: torch.fx.Node, importer: StepImporter) -> relax.Expr:
    x, dt, A, B, C, D, dt_bias, pool, slots, _, _, softplus, dt_min, dt_max = importer.retrieve_args(node)
    _, tokens, heads, head_dim = x.ty.shape
    groups, state_size = int(B.ty.shape[2]), int(B.ty.shape[3])
    dt_max = float(dt_max) if math.isfinite(dt_max) else None
    kernel = ssd_kernel(
        int(heads), int(head_dim), groups, state_size, str(x.ty.dtype), bool(softplus), float(dt_min), dt_max
    )
    floats = [_float32(importer, t, int(heads)) for t in (A, D, dt_bias)]
    inputs = [x, dt, floats[0], B, C, *floats[1:]]
    out = relax.TensorType([1, tokens, heads, head_dim], "float32")
    step = _step_inputs(importer, node, slots)
    return emit_paged_recurrence(importer.block_builder, kernel, "paged_ssd", pool, inputs, step, out)


RECURRENT_CONVERTERS = {
    PAGED_CAUSAL_CONV1D.name: paged_causal_conv1d,
    PAGED_GATED_DELTA_STEP.name: paged_gated_delta_step,
    PAGED_SELECTIVE_STEP.name: paged_selective_step,
    PAGED_SSD_STEP.name: paged_ssd_step,
}
