"""Weight-only quantization formats, defined once for the quantize pass, the ops and the backends.

int4 (group 32/64/128) is stored exactly as ONNX Runtime's MatMulNBits reads it, so the ONNX backend uses
the tensors without repacking; a weight [N, K] becomes
  qweight uint8 [N, blocks, group/2]  two 4-bit values per byte, the even element in the low nibble;
  scales        [N, blocks]            in the model's dtype, or float16 (the scheme's scale_dtype);
  zeros                                zero points: None when symmetric (= 8); asymmetric with
                [N, blocks]            float zero points in the scales' dtype (MatMulNBits takes these), or
          uint8 [N, ceil(blocks/2)]    packed 4-bit integer zero points (the "zp4" variant);
with blocks = ceil(K / group) and K zero-padded to blocks x group. A MoE layer's experts [E, N, K] are E such
weights stacked: each tensor above gets a leading [E] (ONNX Runtime's QMoE reads them so).
Dequantized: (q - zero) * scale.
Symmetric (llama.cpp's Q4_0 grid): scale = p / -8 with p the group's weight of largest |w| (its sign kept, so a
scale may be negative), q = clamp(round(w / scale), -8, 7) + 8: p is step -8 and all 16 steps are in use, where
max|w| / 7 would leave -8 unused (SmolLM2 at q4g32-sym: perplexity 36.6 with max|w| / 7, 31.5 with this).
Asymmetric, float zero points (llama.cpp's Q4_1 grid): scale = (max - min) / 15, q = clamp(round((w - min) /
scale), 0, 15), zero = -min / scale. A checkpoint that was Q4_1 (as the example GGUF is) is reproduced exactly.
Asymmetric, 4-bit zero points: lo = min(w, 0), hi = max(w, 0), scale = (hi - lo) / 15,
zero = clamp(round(-lo / scale), 0, 15), q = clamp(round(w / scale) + zero, 0, 15). Rounding the zero point
to an integer shifts each group by up to scale / 2: on the Q4_1 example this costs +25% perplexity.
int8 is grouped and symmetric in the same layout, one value per byte: qweight uint8 [N, blocks, group],
scales [N, blocks], scale = max|w| / 127, q = clamp(round(w / scale), -127, 127) + 128 (llama.cpp's Q8_0
for group 32, which a Q8_0 tensor is reproduced exactly by). Group 0 means one group per output channel
(blocks = 1, group = K): the layout integer matrix-multiply kernels take, the scale applied after the dot product.
scale_dtype float16 keeps scales (and float zero points) in 16 bits, as llama.cpp's formats do: a 4-bit weight in
groups of 32 then takes 4.5 bits instead of 5 beside float32 scales. Each scale is rounded to float16 before the
weights are rounded against it, so the stored codes are the nearest for the scale kept (a float zero point is
rounded to float16 after: at most 15 * 2^-11 of a step).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GROUP_SIZES = (16, 32, 64, 128, 256)  # the group sizes of ONNX Runtime's MatMulNBits and QMoE (block_size)
SCALE_DTYPES = (None, "float16")


@dataclass(frozen=True)
class QuantScheme:
    """bits 4 with a group size (symmetric, or asymmetric with float or packed 4-bit zero points), or
    bits 8 with a group size or 0, one group per output channel (symmetric); scale_dtype None keeps the scales in
    the weight's dtype, "float16" in 16 bits."""

    bits: int
    group: int = 32
    symmetric: bool = True
    packed_zeros: bool = False
    scale_dtype: str | None = None

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8, got {self.bits}")
        if self.group not in GROUP_SIZES and (self.bits, self.group) != (8, 0):
            raise ValueError(
                f"int{self.bits} needs a group size of 16, 32, 64, 128 or 256"
                + (" (or 0: per channel)" if self.bits == 8 else "")
                + f", got {self.group}"
            )
        if self.bits == 8 and not self.symmetric:
            raise ValueError("int8 is symmetric")
        if self.packed_zeros and self.symmetric:
            raise ValueError("packed zero points are for asymmetric int4")
        if self.scale_dtype not in SCALE_DTYPES:
            raise ValueError(f"scale_dtype must be None or 'float16', got {self.scale_dtype!r}")

    @property
    def name(self) -> str:
        suffix = "-f16" if self.scale_dtype == "float16" else ""
        if self.bits == 8:
            return {32: "q8", 0: "q8c"}.get(self.group, f"q8g{self.group}") + suffix
        return f"q4g{self.group}" + ("-sym" if self.symmetric else "-zp4" if self.packed_zeros else "") + suffix


@dataclass(frozen=True)
class QuantizedWeight:
    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    in_features: int

    def nbytes(self) -> int:
        tensors = [self.qweight, self.scales] + ([self.zeros] if self.zeros is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors)


def pack_nibbles(values: torch.Tensor) -> torch.Tensor:
    """uint8 values 0..15 along the last dim (even length) -> bytes, the even element in the low nibble."""
    return values[..., 0::2] | (values[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_nibbles: bytes -> uint8 values 0..15, twice as many along the last dim. Divides rather
    than shifts: torch-mlir lowers no shift of a scalar amount to StableHLO or TOSA (the mlir backend)."""
    wide = packed.to(torch.int32)
    high = torch.div(wide, 16, rounding_mode="floor")
    return torch.stack((wide - high * 16, high), dim=-1).flatten(-2).to(torch.uint8)


def quantize(weight: torch.Tensor, scheme: QuantScheme) -> QuantizedWeight:
    """Quantize a linear weight [N, K], or a stack of them [..., N, K] (a MoE layer's experts: every tensor of the
    result gets the same leading dims), in any float dtype; the math runs in float32."""
    *rows, in_features = weight.shape
    group = scheme.group or in_features
    blocks = -(-in_features // group)
    w = torch.nn.functional.pad(weight.float(), (0, blocks * group - in_features))
    w = w.reshape(*rows, blocks, group)

    narrow = scheme.scale_dtype == "float16"

    def stored(values: torch.Tensor) -> torch.Tensor:  # float32 scales as float16 ones will hold them
        return values.half().float() if narrow else values

    if scheme.symmetric:
        top = 2 ** (scheme.bits - 1) - 1  # 7 or 127
        if scheme.bits == 4:  # the group's largest |w|, sign kept, at -8: all 16 steps in use
            scales = w.gather(-1, w.abs().argmax(dim=-1, keepdim=True))[..., 0] / -8
        else:
            scales = w.abs().amax(dim=-1) / top
        scales = stored(torch.where(scales == 0, torch.ones_like(scales), scales))
        q = torch.clamp(torch.round(w / scales[..., None]), -top - (scheme.bits == 4), top) + top + 1
        zero = None
    elif not scheme.packed_zeros:
        lo = w.amin(dim=-1)
        scales = (w.amax(dim=-1) - lo) / 15
        scales = stored(torch.where(scales == 0, torch.ones_like(scales), scales))
        q = torch.clamp(torch.round((w - lo[..., None]) / scales[..., None]), 0, 15)
        zero = -lo / scales
    else:
        lo = torch.clamp(w.amin(dim=-1), max=0)
        hi = torch.clamp(w.amax(dim=-1), min=0)
        scales = (hi - lo) / 15
        scales = stored(torch.where(scales == 0, torch.ones_like(scales), scales))
        zero = torch.clamp(torch.round(-lo / scales), 0, 15)
        q = torch.clamp(torch.round(w / scales[..., None]) + zero[..., None], 0, 15)
    return pack(q, scales.to(torch.float16 if narrow else weight.dtype), zero, scheme, in_features)


def pack(
    q: torch.Tensor, scales: torch.Tensor, zero: torch.Tensor | None, scheme: QuantScheme, in_features: int
) -> QuantizedWeight:
    """The stored form of codes q [..., N, blocks, group] (0..15 or 0..255, as floats or integers), their scales
    [..., N, blocks] (in the dtype to keep) and, for asymmetric int4, zero points [..., N, blocks] (float, or
    integers 0..15 with packed_zeros)."""
    if scheme.bits == 8:
        return QuantizedWeight(q.to(torch.uint8), scales, None, in_features)
    if scheme.symmetric:
        zeros = None
    elif scheme.packed_zeros:
        zeros = pack_nibbles(torch.nn.functional.pad(zero, (0, zero.shape[-1] % 2)).to(torch.uint8))
    else:
        zeros = zero.to(scales.dtype)
    return QuantizedWeight(pack_nibbles(q.to(torch.uint8)), scales, zeros, in_features)


def zero_points(zeros: torch.Tensor | None, bits: int, scales: torch.Tensor) -> torch.Tensor:
    """The float zero point of each group [..., N, blocks] (scales' shape): 8 or 128 when symmetric."""
    if zeros is None:
        return torch.full(scales.shape, 2.0 ** (bits - 1))
    if zeros.dtype == torch.uint8:
        return unpack_nibbles(zeros)[..., : scales.shape[-1]].float()
    return zeros.float()


def dequantize(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, bits: int, in_features: int
) -> torch.Tensor:
    """The float32 weight [..., N, K] a quantized weight (qweight [..., N, blocks, bytes]) stands for."""
    q = (unpack_nibbles(qweight) if bits == 4 else qweight).float()  # [..., N, blocks, group]
    w = (q - zero_points(zeros, bits, scales)[..., None]) * scales.float()[..., None]
    return w.flatten(-2)[..., :in_features]
