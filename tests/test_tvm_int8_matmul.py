"""The TVM CPU kernel's int8 path (accuracy_level 4): grouped matmuls (4- and 8-bit weights, per-channel ones too:
one group a row) with x rounded to int8 per group, one row and many, on each int8 dot-product instruction and
vector width this CPU has, against the same integer arithmetic in numpy; groups of less than a vector keep the float
kernel; the option's errors and the artifact's manifest."""

from __future__ import annotations

import dataclasses
import functools
import json
import platform

import numpy as np
import pytest
import torch
import tvm

from llmlower.api import compile_artifact
from llmlower.backends.tvm.compile import tvm_target
from llmlower.backends.tvm.int8_dot import MADDUBS, VNNI, Int8Dot, int8_dot_product
from llmlower.backends.tvm.qlinear_amx_bf16 import BF16_MIN_ROWS
from llmlower.backends.tvm.qlinear_kernel import qlinear_kernel
from llmlower.errors import LlmlowerError
from llmlower.ir.quant import QuantizedWeight, QuantScheme, quantize
from llmlower.passes import build_pipeline

x86 = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="int8 dot products are x86 kernels")
SCHEMES = {  # --quant name: the scheme and the kernel's kind of zero points
    "q4g32-sym": (QuantScheme(4, 32), "none"),
    "q4g32": (QuantScheme(4, 32, symmetric=False), "float"),
    "q4g32-zp4": (QuantScheme(4, 32, symmetric=False, packed_zeros=True), "nibbles"),
    "q4g64-zp4": (QuantScheme(4, 64, symmetric=False, packed_zeros=True), "nibbles"),
    "q4g128-sym": (QuantScheme(4, 128), "none"),
    "q8": (QuantScheme(8, 32), "none"),
    "q8g64": (QuantScheme(8, 64), "none"),
    "q8g128": (QuantScheme(8, 128), "none"),
    "q8c": (QuantScheme(8, 0), "none"),  # per channel: one group a row
}


def _instructions() -> list[Int8Dot]:
    """MADDUBS everywhere on x86, VNNI where this CPU has it, each at every vector width up to this CPU's widest;
    and AMX's tiles (for calls of many rows) where it has them."""
    here = int8_dot_product(tvm_target("cpu"))
    if here is None:
        return []
    kinds = [MADDUBS] + ([VNNI] if here.kind == VNNI else [])
    dots = [Int8Dot(kind, width) for kind in kinds for width in (16, 32, 64) if width <= here.widest]
    return dots + ([here] if here.amx else [])


@functools.cache
def _library(
    dot: Int8Dot | None,
    out_features: int,
    in_features: int,
    group: int,
    bits: int,
    zeros: str,
    scale_dtype: str,
    lanes: int,
):
    """The kernel built with `dot` (None: the float kernel) for this CPU, its float loops `lanes` wide."""
    kernel = qlinear_kernel(out_features, in_features, group, bits, zeros, True, lanes, dot, scale_dtype)
    return tvm.compile(tvm.IRModule({"main": kernel.with_attr("global_symbol", "main")}), target=tvm_target("cpu"))


def _run_kernel(
    dot: Int8Dot | None,
    x: np.ndarray,
    tensors: list[np.ndarray],
    bits: int,
    zeros: str,
    bias: np.ndarray,
    lanes: int = 16,
) -> np.ndarray:
    """x [rows, K] through the kernel built with `dot` (None: the float kernel); returns [rows, N]."""
    qweight = tensors[0]
    out_features, groups, per_group = qweight.shape
    in_features = groups * per_group * 8 // bits
    scale_dtype = str(tensors[1].dtype)
    library = _library(dot, out_features, in_features, in_features // groups, bits, zeros, scale_dtype, lanes)
    placeholder = np.zeros(1, "float32")
    args = [x[None], *tensors[:2], tensors[2] if len(tensors) == 3 else placeholder, bias]
    out = tvm.runtime.tensor(np.zeros((1, x.shape[0], out_features), "float32"))
    library["main"](*(tvm.runtime.tensor(np.ascontiguousarray(a)) for a in args), out)
    return out.numpy()[0]


def _int8_reference(x: np.ndarray, weight: np.ndarray, zero: np.ndarray, scales: np.ndarray, group: int):
    """One row's product as the int8 kernel computes it: x rounded per group to int8 (scale max|x| / 127, ties to even),
    integer dot products with the 4-bit values, then (dot - zero * sum of x's integers) * weight scale * x scale."""
    groups = x.size // group
    xg = x.reshape(groups, group).astype(np.float64)
    x_scale = np.abs(xg).max(axis=1) / 127
    xq = np.rint(xg * np.where(x_scale > 0, 1 / np.where(x_scale > 0, x_scale, 1), 0)[:, None])
    q = weight.reshape(weight.shape[0], groups, group)
    dots = np.einsum("ngk,gk->ng", q, xq)
    return ((dots - zero * xq.sum(axis=1)) * scales * x_scale).sum(axis=1)


def _unpacked(qweight: np.ndarray, bits: int = 4) -> np.ndarray:
    """The integer values [N, K] of a stored weight (4-bit: the even element in the low nibble)."""
    if bits == 8:
        return qweight.reshape(qweight.shape[0], -1).astype(np.float64)
    pairs = np.stack([qweight & 15, qweight >> 4], axis=-1)
    return pairs.reshape(qweight.shape[0], -1).astype(np.float64)


def _zero_points(scheme: QuantScheme, zeros: torch.Tensor | None, groups: int) -> np.ndarray | float:
    if zeros is None:
        return float(2 ** (scheme.bits - 1))
    if scheme.packed_zeros:
        return _unpacked(zeros.numpy())[:, :groups]
    return zeros.numpy().astype(np.float64)


def _quantized_with_extremes(
    out_features: int, in_features: int, scheme: QuantScheme, gen: torch.Generator
) -> tuple[QuantizedWeight, list[np.ndarray]]:
    """Random weights quantized by `scheme` and the kernel's tensors of them (qweight, scales[, zeros]), every
    seventh weight byte 0 and the next but two 255 (4-bit: both nibbles 0 or 15), so that the extreme weights meet
    x's extremes (each group's largest rounds to +-127)."""
    q = quantize(torch.randn(out_features, in_features, generator=gen) * 0.05, scheme)
    tensors = [t.numpy() for t in (q.qweight, q.scales, q.zeros) if t is not None]
    tensors[0].reshape(-1)[::7] = 0
    tensors[0].reshape(-1)[3::7] = 255
    return q, tensors


@x86
@pytest.mark.parametrize(("dot", "quant"), [(d, q) for d in _instructions() for q in sorted(SCHEMES)], ids=str)
def test_rows_in_int8_are_the_integer_arithmetic(dot, quant):
    """One row (decode), five and eleven (tiles of rows and the rest one by one; AVX-512 VNNI without AMX: from
    REGISTER_ROWS, a padded tile in registers), 16 (with AMX: one tile of x, its weights unpacked a window at a time)
    and 37 (tiles: two of 16 rows and a short one), each row as the reference computes it, and off the float kernel
    by the rounding of x only. Groups of 32 take 576 features: 18 groups, which 64-byte vectors of four 4-bit groups
    do not divide (the last two take a 32-byte vector, their packed zero points one byte). Groups of 64 take 1152: 18
    groups, so that every width sums its vectors' lanes a group at a time in blocks (64-byte vectors of one 8-bit
    group: a block of 16) and leaves two groups one vector at a time."""
    scheme, zeros = SCHEMES[quant]
    in_features = {0: 576, 32: 576, 64: 1152}.get(scheme.group, 512)
    rounded = scheme.group or in_features  # the features x is rounded in: per channel, the whole row
    gen = torch.Generator().manual_seed(0)
    out_features = 64
    q, tensors = _quantized_with_extremes(out_features, in_features, scheme, gen)
    bias = torch.randn(out_features, generator=gen).numpy()
    zero = _zero_points(scheme, q.zeros, in_features // rounded)
    weights = _unpacked(tensors[0], scheme.bits)
    for rows in (1, 5, 11, 16, 37):
        x = (torch.randn(rows, in_features, generator=gen) * 3).numpy()
        if rounded < in_features or rows > 1:  # a group of zeros (per channel: a whole row): scale 0, no division
            x[-1, :rounded] = 0
        got = _run_kernel(dot, x, tensors, scheme.bits, zeros, bias)
        exact = _run_kernel(None, x, tensors, scheme.bits, zeros, bias)  # the float kernel: x not rounded
        expected = np.stack([_int8_reference(row, weights, zero, q.scales.numpy(), rounded) for row in x]) + bias
        assert np.abs(got - expected).max() <= 1e-5 * np.abs(expected).max()
        assert 0 < np.abs(got - exact).max() <= 0.02 * np.abs(exact).max()


@x86
def test_groups_of_less_than_a_vector_stay_in_float32():
    """4-bit groups of 16 (8 bytes, less than the narrowest vector): the float kernel's results, bit for bit, whatever
    the instruction. Built with 8 float lanes, as the backend builds it for such groups (with 16 it does not take
    them: a group must fill two vectors of lanes)."""
    scheme = QuantScheme(4, 16)
    gen = torch.Generator().manual_seed(1)
    q = quantize(torch.randn(64, 256, generator=gen), scheme)
    tensors = [q.qweight.numpy(), q.scales.numpy()]
    bias = np.zeros(64, "float32")
    x = torch.randn(3, 256, generator=gen).numpy()
    exact = _run_kernel(None, x, tensors, scheme.bits, "none", bias, lanes=8)
    weight = (_unpacked(tensors[0]) - 8) * np.repeat(tensors[1].astype(np.float64), scheme.group, axis=1)
    np.testing.assert_allclose(exact, x.astype(np.float64) @ weight.T, rtol=1e-4, atol=1e-4)
    for dot in _instructions():
        np.testing.assert_array_equal(_run_kernel(dot, x, tensors, scheme.bits, "none", bias, lanes=8), exact)


@x86
@pytest.mark.parametrize("quant", ["q4g32-sym", "q4g32", "q4g32-zp4", "q8"])
def test_float16_scales_give_what_the_same_scales_in_float32_give(quant):
    """Scales (and float zero points) read as float16 and widened in the kernel: the float32 kernel's results on the
    same values, bit for bit, on the float kernel and the int8 one (one row, a tile, and on AMX one tile of 16 rows,
    whose tasks widen their scales up front, and many; with AVX-512 VNNI, its tiles in registers, whose tasks widen
    nibble zero points too)."""
    scheme, zeros = SCHEMES[quant]
    gen = torch.Generator().manual_seed(4)
    q = quantize(torch.randn(64, 576, generator=gen) * 0.05, QuantScheme(**{**vars(scheme), "scale_dtype": "float16"}))
    narrow = [t.numpy() for t in (q.qweight, q.scales, q.zeros) if t is not None]
    wide = [narrow[0], *(t.astype("float32") if t.dtype == np.float16 else t for t in narrow[1:])]  # zp4: nibbles
    bias = torch.randn(64, generator=gen).numpy()
    x = torch.randn(37, 576, generator=gen).numpy()
    for dot in [None, *_instructions()[-2:]]:  # the float kernel, and this CPU's two widest int8 paths (AMX's too)
        for rows in (x[:1], x[:5], x[:16], x):
            np.testing.assert_array_equal(
                _run_kernel(dot, rows, narrow, scheme.bits, zeros, bias),
                _run_kernel(dot, rows, wide, scheme.bits, zeros, bias),
            )


def _bfloat16(values: np.ndarray) -> np.ndarray:
    """float32 values rounded to the nearest bfloat16 (ties to even), as float64."""
    bits = values.astype(np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16).astype(np.uint32)
    return rounded.view(np.float32).astype(np.float64)


def _amx_bf16() -> Int8Dot | None:
    here = int8_dot_product(tvm_target("cpu")) if platform.machine() in ("x86_64", "AMD64") else None
    return here if here is not None and here.amx_bf16 else None


@x86
@pytest.mark.skipif(_amx_bf16() is None, reason="this CPU has no AMX bfloat16 tiles")
@pytest.mark.parametrize(("quant", "out_features"), [("q4g32-sym", 128), ("q4g32", 96), ("q4g64-zp4", 128)])
def test_prompt_sized_calls_multiply_in_bfloat16(quant, out_features):
    """Calls of BF16_MIN_ROWS rows or more with 4-bit grouped weights take AMX's bfloat16 tiles: x and the
    dequantized weights (scale x q - scale x zero, one rounding) rounded to bfloat16, their products summed in
    float32, as numpy computes them: 96 rows (six tiles), 161 (a short last tile and a padding one), in tasks of 32
    weight rows (96) and of 4 x 32 (128). Closer to the float kernel than x rounded to int8 per group."""
    scheme, zeros = SCHEMES[quant]
    in_features = 576 if scheme.group == 32 else 512
    gen = torch.Generator().manual_seed(5)
    q, tensors = _quantized_with_extremes(out_features, in_features, scheme, gen)
    bias = torch.randn(out_features, generator=gen).numpy()
    groups = in_features // scheme.group
    scales = np.repeat(q.scales.numpy().astype(np.float64), scheme.group, axis=1)
    offsets = np.repeat(q.scales.numpy() * np.float32(_zero_points(scheme, q.zeros, groups)), scheme.group, axis=1)
    weights = _bfloat16((_unpacked(tensors[0]) * scales - offsets).astype(np.float32))
    int8_tiles = dataclasses.replace(_amx_bf16(), amx_bf16=False)
    for rows in (BF16_MIN_ROWS, 161):
        x = (torch.randn(rows, in_features, generator=gen) * 3).numpy()
        got = _run_kernel(_amx_bf16(), x, tensors, scheme.bits, zeros, bias)
        expected = _bfloat16(x) @ weights.T + bias
        assert np.abs(got - expected).max() <= 1e-5 * np.abs(expected).max()
        exact = _run_kernel(None, x, tensors, scheme.bits, zeros, bias)
        in_int8 = _run_kernel(int8_tiles, x, tensors, scheme.bits, zeros, bias)
        assert np.abs(got - exact).mean() < np.abs(in_int8 - exact).mean()


@x86
def test_a_tvm_artifact_records_its_level_and_verifies(tiny_llama, tmp_path):
    """The default (4) on this CPU: recorded in the manifest, and compile --verify passes it within the tolerance
    of rounded activations; level 0 records 0."""
    for level, recorded in ((None, 4), (0, 0)):
        out = tmp_path / f"level-{level}"
        compile_artifact(
            tiny_llama, out, build_pipeline(quant="q4g32"), backend="tvm", accuracy_level=level, verify=True
        )
        assert json.loads((out / "manifest.json").read_text())["tvm"]["accuracy_level"] == recorded


@pytest.mark.parametrize(
    ("target", "level", "message"),
    [
        ("cpu", 2, "--accuracy-level 2: the tvm backend takes 0 (float32) or 4 (int8 activations)"),
        ("cuda", 4, "--accuracy-level 4: the tvm backend's int8 matmuls are CPU kernels"),
    ],
)
def test_levels_the_backend_cannot_build_are_refused(tiny_llama, tmp_path, target, level, message):
    with pytest.raises(LlmlowerError, match=message.replace("(", r"\(").replace(")", r"\)")):
        compile_artifact(tiny_llama, tmp_path / "out", backend="tvm", target=target, accuracy_level=level)
    assert not (tmp_path / "out").exists()
