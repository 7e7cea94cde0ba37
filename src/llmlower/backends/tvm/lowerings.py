"""Relax lowerings of the op set: one converter per op for `from_exported_program(custom_convert_map=...)`.

A converter gets the FX node and the importer (a `StepImporter`, which holds the target and the step's
int32 inputs for the attention kernels) and emits Relax. Paged attention goes to llmlower's TIR kernels over
the caller's block pools (paged_kernels.py); `qlinear` is one TE function that dequantizes inside the matmul's
reduction, the form DLight's GEMV/matmul rules schedule. The MoE experts are four TE functions (up matmul,
gated activation, down matmul, weighted sum over the top-k), so that each matmul is a single reduction the
schedules take.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch.fx
from tvm import relax, te, tirx

from ...errors import LlmlowerError
from ...ir import (
    ADD_RMS_NORM,
    MOE_EXPERTS,
    PAGED_ATTENTION,
    PAGED_LATENT_ATTENTION,
    PAGED_QKV_ATTENTION,
    QEMBEDDING,
    QLINEAR,
    QMOE_EXPERTS,
    RMS_NORM,
    ROPE,
    SILU_MUL,
)
from . import norm_kernel, rope_kernel, silu_mul_kernel
from .cpu_schedule import dequantize_lanes
from .paged_kernels import emit_paged_attention, emit_paged_latent_attention
from .qlinear_kernel import emit_qlinear, emit_qlinear_experts, experts_take, nibble_order, takes
from .recurrent_lowerings import RECURRENT_CONVERTERS
from .swiglu import Gate, swiglu

if TYPE_CHECKING:
    from .relax_import import StepImporter


class TvmLoweringError(LlmlowerError):
    """A node of the program has no Relax lowering."""


Converter = Callable[[torch.fx.Node, "StepImporter"], relax.Expr]


def _emit(importer: StepImporter, expr: relax.Expr) -> relax.Var:
    return importer.block_builder.emit(expr)


def _last(x: relax.Expr) -> int:
    """The last axis as a non-negative number (Relax's dynamic-shape slicing wants one)."""
    return x.ty.ndim - 1


def rms_norm(node: torch.fx.Node, importer: StepImporter) -> relax.Expr:
    x, weight, eps = importer.retrieve_args(node)
    return _emit(importer, relax.op.nn.rms_norm(x, weight, axes=-1, epsilon=eps))


def add_rms_norm(node: torch.fx.Node, importer: StepImporter) -> relax.Expr:
    x, residual, weight, eps = importer.retrieve_args(node)
    if importer.target.kind.name == "llvm" and norm_kernel.takes(x, residual, weight):
        return norm_kernel.emit_add_rms_norm(importer.block_builder, x, residual, weight, eps)
    total = _emit(importer, relax.op.add(x, residual))
    normed = _emit(importer, relax.op.nn.rms_norm(total, weight, axes=-1, epsilon=eps))
    return relax.Tuple([normed, total])


def silu_mul(node: torch.fx.Node, importer: StepImporter) -> relax.Expr:
    (x,) = importer.retrieve_args(node)
    if importer.target.kind.name == "llvm" and silu_mul_kernel.takes(x):
        return silu_mul_kernel.emit_silu_mul(importer.block_builder, x)
    halves = _emit(importer, relax.op.split(x, 2, axis=_last(x)))
    gate, up = (_emit(importer, relax.TupleGetItem(halves, i)) for i in range(2))
    return _emit(importer, relax.op.multiply(relax.op.nn.silu(gate), up))


def _rotate(importer: StepImporter, x: relax.Expr, cos: relax.Expr, sin: relax.Expr) -> relax.Var:
    """x * cos + rotate_half(x) * sin over the last axis."""
    halves = _emit(importer, relax.op.split(x, 2, axis=_last(x)))
    first, second = (_emit(importer, relax.TupleGetItem(halves, i)) for i in range(2))
    rotated = _emit(importer, relax.op.concat([relax.op.negative(second), first], axis=_last(x)))
    return _emit(importer, relax.op.add(relax.op.multiply(x, cos), relax.op.multiply(rotated, sin)))


def rope(node: torch.fx.Node, importer: StepImporter) -> relax.Expr:
    x, cos, sin = importer.retrieve_args(node)
    return _rotate(importer, x, cos, sin)


# the attention ops' last arguments (k_scale / v_scale: an int8 cache's, kv_cache_dtype)
EXTRAS = {"window": 0, "softcap": 0.0, "sinks": None, "alibi_slopes": None, "k_scale": None, "v_scale": None}


def _extras(node: torch.fx.Node, args: list, at: int) -> dict:
    """The op's window, softcap, sinks, ALiBi slopes and cache scales from argument `at` on (torch.export leaves out
    those at their defaults)."""
    given = dict(zip(EXTRAS, args[at:], strict=False))
    return {name: node.kwargs.get(name, given.get(name, default)) for name, default in EXTRAS.items()}


def _kernel_options(
    importer: StepImporter, node: torch.fx.Node, args: list, pools: tuple[relax.Expr, relax.Expr], heads: int, at: int
) -> dict:
    """The keyword arguments of emit_paged_attention for pools [num_blocks, block_size, kv_heads, head_dim] (the
    value pool's last dimension its own) and the op's scale (argument at - 1) and extras (from `at` on)."""
    k_pool, v_pool = pools
    block_size, kv_heads, head_dim = (int(k_pool.ty.shape[i]) for i in (1, 2, 3))
    extras = _extras(node, args, at)
    return {
        "heads": int(heads),
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "block_size": block_size,
        "scale": float(args[at - 1]),
        "window": int(extras["window"]),
        "target": importer.target,
        "softcap": float(extras["softcap"]),
        "sinks": extras["sinks"],
        "value_head_dim": int(v_pool.ty.shape[3]),
        "alibi_slopes": extras["alibi_slopes"],
        "k_scale": extras["k_scale"],
        "v_scale": extras["v_scale"],
    }


def _packed_rows(importer: StepImporter, x: relax.Expr) -> relax.Var:
    """[1, heads, N, d] (the ops' packed tokens) -> [N, heads, d] (the kernels' rows)."""
    _, heads, tokens, dim = x.ty.shape
    return _emit(importer, relax.op.reshape(relax.op.permute_dims(x, [0, 2, 1, 3]), [tokens, heads, dim]))


def _packed_heads(importer: StepImporter, rows: relax.Expr) -> relax.Var:
    """[N, heads, d] (the kernels' rows) -> [1, heads, N, d] (the ops' packed tokens)."""
    return _emit(importer, relax.op.permute_dims(relax.op.reshape(rows, [1, *rows.ty.shape]), [0, 2, 1, 3]))


def paged_attention(node: torch.fx.Node, importer: StepImporter) -> relax.Expr:
    """q [1, H, N, D] and k, v [1, KV, N, D], already rotated, packed tokens: the paged kernels append k/v into
    the pools (in place) and attend; the op's updated-pool outputs are the pools themselves."""
    args = importer.retrieve_args(node)
    q, k, v, k_pool, v_pool = args[:5]
    out = emit_paged_attention(
        importer.block_builder,
        *(_packed_rows(importer, x) for x in (q, k, v)),
        k_pool,
        v_pool,
        *importer.kernel_inputs(),
        **_kernel_options(importer, node, args, (k_pool, v_pool), q.ty.shape[1], 9),
    )
    return relax.Tuple([_packed_heads(importer, out), k_pool, v_pool])


def paged_qkv_attention(node: torch.fx.Node, importer: StepImporter) -> relax.Expr:
    """Fused qkv [1, N, (H + 2 KV) * D], packed tokens: q and k rotated here with the tables' rows at
    position_ids (each token's position in its sequence), then the paged kernels as in paged_attention."""
    args = importer.retrieve_args(node)
    qkv, k_pool, v_pool, _, _, _, cos_table, sin_table, heads, kv_heads = args[:10]
    head_dim, value_head_dim = int(k_pool.ty.shape[3]), int(v_pool.ty.shape[3])
    tokens = qkv.ty.shape[1]
    if importer.target.kind.name == "llvm" and rope_kernel.takes(qkv, cos_table, sin_table, head_dim):
        q, k, v = rope_kernel.emit_rotated_qkv(
            importer.block_builder,
            qkv,
            importer.position_ids,
            (cos_table, sin_table),
            heads,
            kv_heads,
            head_dim,
            value_head_dim,
        )
    else:
        cos, sin = importer.rotary(cos_table, sin_table)
        parts = _emit(importer, relax.op.split(qkv, [heads * head_dim, (heads + kv_heads) * head_dim], axis=2))
        q, k, v = (_emit(importer, relax.TupleGetItem(parts, i)) for i in range(3))
        heads_of = ((heads, head_dim), (kv_heads, head_dim), (kv_heads, value_head_dim))
        q, k, v = (
            _emit(importer, relax.op.reshape(x, [tokens, *shape])) for x, shape in zip((q, k, v), heads_of, strict=True)
        )
        q, k = (_rotate(importer, x, cos, sin) for x in (q, k))
    out = emit_paged_attention(
        importer.block_builder,
        q,
        k,
        v,
        k_pool,
        v_pool,
        *importer.kernel_inputs(),
        **_kernel_options(importer, node, args, (k_pool, v_pool), heads, 11),
    )
    out = _emit(importer, relax.op.reshape(out, [1, tokens, heads * value_head_dim]))
    return relax.Tuple([out, k_pool, v_pool])


def paged_latent_attention(node: torch.fx.Node, importer: StepImporter) -> relax.Expr:
    """q [1, H, N, nope + rope] and the step's latent [1, 1, N, rank] and k_pe [1, 1, N, rope], packed tokens:
    emit_paged_latent_attention over the latent (k) and rotary-key (v) pools; the op's updated-pool outputs are the
    pools themselves."""
    args = importer.retrieve_args(node)
    q, latent, k_pe, kv_weight, c_pool, pe_pool = args[:6]
    out = emit_paged_latent_attention(
        importer.block_builder,
        *(_packed_rows(importer, x) for x in (q, latent, k_pe)),
        kv_weight,
        c_pool,
        pe_pool,
        *importer.kernel_inputs(),
        scale=float(args[9]),
        window=int(_extras(node, args, 10)["window"]),
        target=importer.target,
    )
    return relax.Tuple([_packed_heads(importer, out), c_pool, pe_pool])


def _dequantized(
    qweight: te.Tensor,
    scales: te.Tensor,
    zeros: te.Tensor | None,
    bits: int,
    nibble_major: bool = False,
    dtype: str | None = None,
) -> Callable[..., tirx.PrimExpr]:
    """A TE expression builder w(*rows, k) for the float weight of a quantized one (ir/quant.py's layout:
    qweight [..., N, blocks, bytes per block], nibbles low first; zeros None, float [..., N, blocks] or nibbles;
    `rows` index the leading dims and N: (n,) for a linear, (expert, n) for a MoE layer's experts), in `dtype`
    (default the scales'). `nibble_major` (4 bits): k counts each group's low nibbles, then its high ones (see
    `nibble_order`)."""
    dtype = dtype or scales.dtype
    per_byte = 8 // bits
    group = int(qweight.shape[-1]) * per_byte
    half = group // 2

    def quantized(rows: tuple, k: tirx.PrimExpr) -> tirx.PrimExpr:
        if bits == 8:
            return qweight[(*rows, k // group, k % group)]
        if nibble_major:  # consecutive k: consecutive bytes, one shift
            return (qweight[(*rows, k // group, k % half)] >> (k % group // half * 4).astype("uint8")) & 15
        return (qweight[(*rows, k // group, k % group // 2)] >> (k % 2 * 4).astype("uint8")) & 15

    def weight(*index: tirx.PrimExpr) -> tirx.PrimExpr:
        rows, k = index[:-1], index[-1]
        block = k // group
        if zeros is None:
            zero = tirx.const(2 ** (bits - 1), dtype)
        elif zeros.dtype == "uint8":
            zero = ((zeros[(*rows, block // 2)] >> ((block % 2) * 4).astype("uint8")) & 15).astype(dtype)
        else:
            zero = zeros[(*rows, block)].astype(dtype)
        return (quantized(rows, k).astype(dtype) - zero) * scales[(*rows, block)].astype(dtype)

    return weight


def weight_dtype(x: relax.Expr, scales: relax.Expr) -> str:
    """The dtype a matmul dequantizes its weights in: the scales' where x has it, else float32 (float16 scales
    beside float32 or bfloat16 activations)."""
    return scales.ty.dtype if scales.ty.dtype == x.ty.dtype else "float32"


def _reduced_in_nibble_order(bits: int, group: int, in_features: int, cpu: bool) -> bool:
    """Whether a matmul reduces 4-bit weights in `nibble_order`: on the CPU (DLight's GPU GEMV rule fails on the
    reordered x), where the groups divide the features (a padded last group keeps the plain order)."""
    return cpu and bits == 4 and in_features % group == 0


def _in_nibble_order(x: te.Tensor, group: int) -> te.Tensor:
    """x's features in the order a nibble-major reduction reads the weights, once (the matmul then reads both
    contiguously)."""
    feature = nibble_order(group)
    return te.compute(x.shape, lambda *i: x[(*i[:-1], feature(i[-1]))], name="nibble_order")


def _qlinear_te(
    x: te.Tensor, qweight, scales, zeros, bias, bits: int, in_features: int, cpu: bool, dtype: str
) -> te.Tensor:
    """x @ dequantize(w).T (+ bias), the weights in `dtype`, accumulated in float32 whatever x's dtype."""
    group = int(qweight.shape[2]) * 8 // bits
    nibble_major = _reduced_in_nibble_order(bits, group, in_features, cpu)
    weight = _dequantized(qweight, scales, zeros, bits, nibble_major, dtype)
    w = te.compute((qweight.shape[0], in_features), weight, name="dequantize")
    if nibble_major:
        x = _in_nibble_order(x, group)
    k = te.reduce_axis((0, in_features), name="k")
    out = te.compute(
        (*x.shape[:-1], qweight.shape[0]),
        lambda *i: te.sum(x[(*i[:-1], k)].astype("float32") * w[i[-1], k].astype("float32"), axis=k),
        name="matmul",
    )
    if bias is not None:
        out = te.compute(out.shape, lambda *i: out[i] + bias[i[-1]].astype("float32"), name="bias_add")
    if x.dtype != "float32":
        out = te.compute(out.shape, lambda *i: out[i].astype(x.dtype), name="cast")
    return out


def qlinear(node: torch.fx.Node, importer: StepImporter) -> relax.Expr:
    x, qweight, scales, zeros, bias, bits, in_features = importer.retrieve_args(node)
    cpu, dtype = importer.target.kind.name == "llvm", weight_dtype(x, scales)
    if cpu:
        group = int(qweight.ty.shape[2]) * 8 // bits
        lanes = dequantize_lanes(importer.target, group)
        if takes(x, scales, bits, group, in_features, int(qweight.ty.shape[0]), lanes):
            return emit_qlinear(
                importer.block_builder, x, qweight, scales, zeros, bias, bits, in_features, lanes, importer.int8_dot
            )
    tensors = [x, qweight, scales] + [t for t in (zeros, bias) if t is not None]

    def compute(x, qweight, scales, *rest):
        rest = list(rest)
        z = rest.pop(0) if zeros is not None else None
        b = rest.pop(0) if bias is not None else None
        return _qlinear_te(x, qweight, scales, z, b, bits, in_features, cpu, dtype)

    return importer.block_builder.emit_te(compute, *tensors, primfunc_name_hint="dequantize_matmul")


def qembedding(node: torch.fx.Node, importer: StepImporter) -> relax.Expr:
    ids, qweight, scales, zeros, bits, dim = importer.retrieve_args(node)
    tensors = [ids, qweight, scales] + ([zeros] if zeros is not None else [])

    def compute(ids, qweight, scales, zeros=None):
        weight = _dequantized(qweight, scales, zeros, bits)
        return te.compute((*ids.shape, dim), lambda *i: weight(ids[i[:-1]], i[-1]), name="dequantize_take")

    return importer.block_builder.emit_te(compute, *tensors, primfunc_name_hint="dequantize_take")


SWIGLU_DEFAULTS: Gate = (1.0, 0.0, 0.0)  # moe_experts' alpha, beta, limit
ExpertWeight = Callable[..., "tirx.PrimExpr"]  # (expert, row, column) -> the weight there
ExpertEmitter = Callable[[relax.Expr, relax.Expr], relax.Expr]  # (x, ids) -> x times the chosen experts, [T, top_k, N]


@dataclass(frozen=True)
class ExpertMatmul:
    """One of the experts' matmuls: its weight tensors (float [E, N, K], or packed, scales and zero points), how a
    kernel reads w(expert, n, k) from their TE placeholders, the bias [E, N] if any, and the group whose nibble
    order the reduction follows (None: the plain order)."""

    tensors: list[relax.Expr]
    read: Callable[..., ExpertWeight]
    bias: relax.Expr | None
    nibble_group: int | None = None

    @property
    def rows(self) -> int:
        """N: the output features."""
        return int(self.tensors[0].ty.shape[1])


def _float_experts(weight: relax.Expr, bias: relax.Expr | None) -> ExpertMatmul:
    """The experts' float weights [E, N, K], read where the matmul multiplies them."""

    def read(w: te.Tensor) -> ExpertWeight:
        return lambda e, n, k: w[e, n, k]

    return ExpertMatmul([weight], read, bias)


def _quantized_experts(
    qweight, scales, zeros, bias, bits: int, in_features: int, cpu: bool, dtype: str
) -> ExpertMatmul:
    """The experts' packed weights, dequantized in `dtype` where the matmul reads them (as qlinear's, a leading
    [E])."""
    group = int(qweight.ty.shape[-1]) * 8 // bits
    nibble_major = _reduced_in_nibble_order(bits, group, in_features, cpu)

    def read(qweight: te.Tensor, scales: te.Tensor, zeros: te.Tensor | None = None) -> ExpertWeight:
        return _dequantized(qweight, scales, zeros, bits, nibble_major, dtype)

    tensors = [t for t in (qweight, scales, zeros) if t is not None]
    return ExpertMatmul(tensors, read, bias, group if nibble_major else None)


def _expert_matmul_te(
    x: te.Tensor, ids: te.Tensor, weight: ExpertWeight, rows: int, bias: te.Tensor | None
) -> te.Tensor:
    """out[t, j, n] = sum_k x[t, (j,) k] * w(ids[t, j], n, k) (+ bias[ids[t, j], n]) in float32: one reduction that
    reads each chosen expert's weight rows where it multiplies them (the form WeightRowMatmul schedules). x is
    [T, K], shared by a token's experts (up), or [T, top_k, K], one row per chosen expert (down)."""
    tokens, top_k = ids.shape
    k = te.reduce_axis((0, x.shape[-1]), name="k")

    def x_at(t: tirx.PrimExpr, j: tirx.PrimExpr) -> tirx.PrimExpr:
        return (x[t, j, k] if len(x.shape) == 3 else x[t, k]).astype("float32")

    out = te.compute(
        (tokens, top_k, rows),
        lambda t, j, n: te.sum(x_at(t, j) * weight(ids[t, j], n, k).astype("float32"), axis=k),
        name="matmul",
    )
    if bias is None:
        return out
    return te.compute(out.shape, lambda t, j, n: out[t, j, n] + bias[ids[t, j], n].astype("float32"), name="bias_add")


def _swiglu_te(gate_up: te.Tensor, gate: Gate) -> te.Tensor:
    """swiglu.swiglu of interleaved gate/up rows [T, top_k, 2I] -> [T, top_k, I]."""
    tokens, top_k, rows = gate_up.shape
    return te.compute(
        (tokens, top_k, rows // 2),
        lambda t, j, i: swiglu(gate_up[t, j, 2 * i], gate_up[t, j, 2 * i + 1], gate),
        name="swiglu",
    )


def _combine_te(expert_out: te.Tensor, weights: te.Tensor, dtype: str) -> te.Tensor:
    """sum_j weights[t, j] * expert_out[t, j, :]: each token's chosen experts weighted by the router, in `dtype`
    (cast after the float32 sum: TE allows a reduction only at the top of a compute)."""
    tokens, top_k, hidden = expert_out.shape
    j = te.reduce_axis((0, top_k), name="j")
    summed = te.compute(
        (tokens, hidden),
        lambda t, d: te.sum(expert_out[t, j, d] * weights[t, j].astype("float32"), axis=j),
        name="combine",
    )
    if dtype == "float32":
        return summed
    return te.compute(summed.shape, lambda t, d: summed[t, d].astype(dtype), name="combine_cast")


def _emit_expert_matmul(importer: StepImporter, x: relax.Expr, ids: relax.Expr, matmul: ExpertMatmul, name: str):
    """x times the chosen experts' weights (+ bias), one kernel: _expert_matmul_te, x in the weights' nibble order
    first where they have one (computed once, outside the reduction)."""
    bias = [matmul.bias] if matmul.bias is not None else []

    def compute(x: te.Tensor, ids: te.Tensor, *tensors: te.Tensor) -> te.Tensor:
        weights, bias_tensor = (tensors[:-1], tensors[-1]) if bias else (tensors, None)
        if matmul.nibble_group is not None:
            x = _in_nibble_order(x, matmul.nibble_group)
        return _expert_matmul_te(x, ids, matmul.read(*weights), matmul.rows, bias_tensor)

    return importer.block_builder.emit_te(compute, x, ids, *matmul.tensors, *bias, primfunc_name_hint=name)


def _emit_moe(
    importer: StepImporter,
    x: relax.Expr,
    ids: relax.Expr,
    weights: relax.Expr,
    up: ExpertEmitter,
    down: ExpertEmitter,
) -> relax.Var:
    """The chosen experts of each token: up matmul, down matmul (which applies the gated activation to the up
    matmul's output), weighted sum over the top-k. The matmuls read the expert weights at the router's ids, so a
    step reads the chosen experts' rows only (never a gathered or dequantized copy)."""
    expert_out = down(up(x, ids), ids)
    return importer.block_builder.emit_te(
        _combine_te, expert_out, weights, x.ty.dtype, primfunc_name_hint="moe_combine"
    )


def _gate(args: list) -> Gate:
    """alpha, beta, limit from the op's trailing arguments (the export leaves default arguments out)."""
    return tuple(float(v) for v in (*args, *SWIGLU_DEFAULTS[len(args) :]))


def _in_te(importer: StepImporter, matmul: ExpertMatmul, name: str, gate: Gate | None = None) -> ExpertEmitter:
    """The matmul as _emit_expert_matmul's one TE kernel, after the gated activation as a kernel of its own where
    `gate` is given (down)."""
    bb = importer.block_builder

    def emit(x: relax.Expr, ids: relax.Expr) -> relax.Expr:
        if gate is not None:
            x = bb.emit_te(_swiglu_te, x, gate, primfunc_name_hint="moe_swiglu")
        return _emit_expert_matmul(importer, x, ids, matmul, name)

    return emit


def moe_experts(node: torch.fx.Node, importer: StepImporter) -> relax.Expr:
    x, ids, weights, w_up, b_up, w_down, b_down, *gate = importer.retrieve_args(node)
    up, down = _float_experts(w_up, b_up), _float_experts(w_down, b_down)
    up_emitter, down_emitter = _in_te(importer, up, "moe_up"), _in_te(importer, down, "moe_down", _gate(gate))
    return _emit_moe(importer, x, ids, weights, up_emitter, down_emitter)


def qmoe_experts(node: torch.fx.Node, importer: StepImporter) -> relax.Expr:
    """The packed experts: each matmul on the int8 kernel where the CPU path rounds x (accuracy_level 4), else each
    weight dequantized where its matmul's reduction reads it."""
    args = importer.retrieve_args(node)
    x, ids, weights, up_q, up_s, up_z, b_up, up_bits, down_q, down_s, down_z, b_down, down_bits, *gate = args
    cpu = importer.target.kind.name == "llvm"
    hidden, intermediate = int(x.ty.shape[-1]), int(up_q.ty.shape[1]) // 2

    def emitter(q, s, z, b, bits, in_features, name, gated=None) -> ExpertEmitter:  # int8 where the CPU rounds x
        if cpu and experts_take(x, q, s, bits, in_features, importer.int8_dot):
            bb, int8_dot = importer.block_builder, importer.int8_dot
            return lambda x, ids: emit_qlinear_experts(bb, x, ids, q, s, z, b, bits, in_features, int8_dot, gated)
        matmul = _quantized_experts(q, s, z, b, bits, in_features, cpu, weight_dtype(x, s))
        return _in_te(importer, matmul, name, gated)

    up = emitter(up_q, up_s, up_z, b_up, up_bits, hidden, "moe_up")
    down = emitter(down_q, down_s, down_z, b_down, down_bits, intermediate, "moe_down", _gate(gate))
    return _emit_moe(importer, x, ids, weights, up, down)


def _matmul_float32(importer: StepImporter, a: relax.Expr, b: relax.Expr) -> relax.Expr:
    """a @ b accumulated in float32 and returned in a's dtype (TVM's importer returns float32 for float16 inputs,
    which breaks the float16 graph that follows)."""
    product = relax.op.matmul(a, b, out_dtype="float32")
    return _emit(importer, product if a.ty.dtype == "float32" else relax.op.astype(product, a.ty.dtype))


def mm(node: torch.fx.Node, importer: StepImporter) -> relax.Expr:
    a, b = importer.retrieve_args(node)
    return _matmul_float32(importer, a, b)


def addmm(node: torch.fx.Node, importer: StepImporter) -> relax.Expr:
    """bias + a @ b (beta = alpha = 1, what linear layers export as)."""
    if node.kwargs.get("alpha", 1) != 1 or node.kwargs.get("beta", 1) != 1:
        raise TvmLoweringError(f"node {node.name}: addmm with alpha/beta other than 1 has no lowering")
    bias, a, b = importer.retrieve_args(node)
    return _emit(importer, relax.op.add(bias, _matmul_float32(importer, a, b)))


def select(node: torch.fx.Node, importer: StepImporter) -> relax.Expr:
    """x.select(dim, index): take at a single index with the axis dropped. A negative index counts from the end, as
    in torch (TVM's own take reads it as it stands, out of bounds: falcon's x[..., -2, :] of grouped k and v); a
    symbolic axis wraps it at run time."""
    x, dim, index = importer.retrieve_args(node)
    dim %= x.ty.ndim
    size, mode = x.ty.shape[dim], "fast"
    if isinstance(index, int) and index < 0:
        if isinstance(size, tirx.IntImm):
            index += int(size)
        else:
            mode = "wrap"
    return _emit(importer, relax.op.take(x, relax.const(index, "int64"), dim, mode=mode))


def full_like(node: torch.fx.Node, importer: StepImporter) -> relax.Expr:
    """torch.full_like: an infinite or NaN fill (a router's -inf before its top-k scatter, Llama 4's) as the
    constant broadcast to x's shape, which TVM legalizes; its own full_like fails there (topi.full is handed a
    PrimType where it checks for a float dtype name)."""
    x, value = importer.retrieve_args(node)[:2]
    if not (isinstance(value, float) and not math.isfinite(value)) or node.kwargs.get("dtype") is not None:
        return importer._full_like(node)
    return _emit(importer, relax.op.broadcast_to(relax.const(value, x.ty.dtype), x.ty.shape))


CONVERTERS: dict[str, Converter] = {
    RMS_NORM.name: rms_norm,
    ADD_RMS_NORM.name: add_rms_norm,
    SILU_MUL.name: silu_mul,
    ROPE.name: rope,
    PAGED_ATTENTION.name: paged_attention,
    PAGED_QKV_ATTENTION.name: paged_qkv_attention,
    PAGED_LATENT_ATTENTION.name: paged_latent_attention,
    QLINEAR.name: qlinear,
    QEMBEDDING.name: qembedding,
    MOE_EXPERTS.name: moe_experts,
    QMOE_EXPERTS.name: qmoe_experts,
    **RECURRENT_CONVERTERS,
}


# aten ops whose conversion by TVM's importer we replace, keyed as the importer looks them up
ATEN_CONVERTERS: dict[str, Converter] = {
    "mm.default": mm,
    "matmul.default": mm,
    "addmm.default": addmm,
    "select.int": select,
    "full_like.default": full_like,
}


def convert_map() -> dict[str, Converter]:
    """The converters keyed as the importer looks ops up (the overload's __name__, e.g. 'rms_norm.default')."""
    return {f"{name}.default": converter for name, converter in CONVERTERS.items()} | ATEN_CONVERTERS
