"""The TVM CPU kernel's int8 path (accuracy_level 4): one activation row's matmul (4-bit weights, and 8-bit ones with
VNNI) with x rounded to int8 per group, on each int8 dot-product instruction this CPU has, against the same integer
arithmetic in numpy; several rows, per-channel int8 and 8-bit without VNNI keep the float kernel; the option's
errors and the artifact's manifest."""

from __future__ import annotations

import json
import platform

import numpy as np
import pytest
import torch
import tvm

from llmlower.api import compile_artifact
from llmlower.backends.tvm.compile import tvm_target
from llmlower.backends.tvm.int8_dot import MADDUBS, VNNI, int8_dot_product
from llmlower.backends.tvm.qlinear_kernel import qlinear_kernel
from llmlower.errors import LlmlowerError
from llmlower.ir.quant import QuantScheme, quantize
from llmlower.passes import build_pipeline

x86 = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="int8 dot products are x86 kernels")
SCHEMES = {  # --quant name: the scheme and the kernel's kind of zero points
    "q4g32-sym": (QuantScheme(4, 32), "none"),
    "q4g32": (QuantScheme(4, 32, symmetric=False), "float"),
    "q4g64-zp4": (QuantScheme(4, 64, symmetric=False, packed_zeros=True), "nibbles"),
    "q4g128-sym": (QuantScheme(4, 128), "none"),
    "q8": (QuantScheme(8, 32), "none"),
    "q8g128": (QuantScheme(8, 128), "none"),
}


def _kinds() -> list[str]:
    """MADDUBS everywhere on x86; VNNI where this CPU has it."""
    return [MADDUBS] + ([VNNI] if int8_dot_product(tvm_target("cpu")) == VNNI else [])


def _run_kernel(
    kind: str | None, x: np.ndarray, tensors: list[np.ndarray], bits: int, zeros: str, bias: np.ndarray
) -> np.ndarray:
    """x [rows, K] through the kernel built with `kind` for this CPU; returns [rows, N]."""
    qweight = tensors[0]
    out_features, groups, per_group = qweight.shape
    in_features = groups * per_group * 8 // bits
    kernel = qlinear_kernel(out_features, in_features, in_features // groups, bits, zeros, True, 16, kind)
    library = tvm.compile(tvm.IRModule({"main": kernel.with_attr("global_symbol", "main")}), target=tvm_target("cpu"))
    placeholder = np.zeros(1, "float32")
    args = [x[None], *tensors[:2], tensors[2] if len(tensors) == 3 else placeholder, bias]
    out = tvm.runtime.tensor(np.zeros((1, x.shape[0], out_features), "float32"))
    library["main"](*(tvm.runtime.tensor(np.ascontiguousarray(a)) for a in args), out)
    return out.numpy()[0]


def _int8_reference(x: np.ndarray, weight: np.ndarray, zero: np.ndarray, scales: np.ndarray, group: int):
    """One row's product as the kernel computes it: x rounded per group to int8 (scale max|x| / 127, ties to even),
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


def _cases() -> list[tuple[str, str]]:
    """(instruction, --quant) pairs that take the int8 path: 8-bit weights with VNNI only."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return []
    return [(kind, quant) for kind in _kinds() for quant in sorted(SCHEMES) if kind == VNNI or "q8" not in quant]


@x86
@pytest.mark.parametrize(("kind", "quant"), _cases())
def test_one_row_in_int8_is_the_integer_arithmetic(kind, quant):
    scheme, zeros = SCHEMES[quant]
    gen = torch.Generator().manual_seed(0)
    out_features, in_features = 128, 512
    weight = torch.randn(out_features, in_features, generator=gen) * 0.05
    q = quantize(weight, scheme)
    tensors = [t.numpy() for t in (q.qweight, q.scales, q.zeros) if t is not None]
    bias = torch.randn(out_features, generator=gen).numpy()
    x = (torch.randn(1, in_features, generator=gen) * 3).numpy()
    x[0, : scheme.group] = 0  # a group of zeros: scale 0, no division by it
    groups = in_features // scheme.group

    got = _run_kernel(kind, x, tensors, scheme.bits, zeros, bias)[0]
    zero = _zero_points(scheme, q.zeros, groups)
    weights = _unpacked(tensors[0], scheme.bits)
    expected = _int8_reference(x[0], weights, zero, q.scales.numpy(), scheme.group) + bias
    assert np.abs(got - expected).max() <= 1e-5 * np.abs(expected).max()
    exact = _run_kernel(None, x, tensors, scheme.bits, zeros, bias)[0]  # the float kernel: x not rounded
    assert 0 < np.abs(got - exact).max() <= 0.02 * np.abs(exact).max()


@x86
@pytest.mark.parametrize(
    ("scheme", "rows", "kinds"),
    [
        (QuantScheme(4, 32), 3, _kinds),  # a prompt's rows, or the LM head over several sequences
        (QuantScheme(8, 0), 1, _kinds),  # q8c: one group a row
        (QuantScheme(8, 32), 1, lambda: [MADDUBS]),  # pmaddubsw's int16 pair sums (255 x 127 x 2) would saturate
    ],
)
def test_what_the_int8_path_does_not_take_stays_in_float32(scheme, rows, kinds):
    """Several rows, per-channel int8 and 8-bit weights without VNNI: the float kernel's results, bit for bit."""
    gen = torch.Generator().manual_seed(rows)
    q = quantize(torch.randn(64, 256, generator=gen), scheme)
    tensors = [q.qweight.numpy(), q.scales.numpy()]
    bias = np.zeros(64, "float32")
    x = torch.randn(rows, 256, generator=gen).numpy()
    for kind in kinds():
        np.testing.assert_array_equal(
            _run_kernel(kind, x, tensors, scheme.bits, "none", bias),
            _run_kernel(None, x, tensors, scheme.bits, "none", bias),
        )


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
