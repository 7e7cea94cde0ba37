"""The x86 instruction that multiplies unsigned bytes by signed ones and adds each four adjacent products into one
int32 lane, chosen from what the target CPU has: VNNI's vpdpbusd (AVX-512 VNNI, or AVX-VNNI), else pmaddubsw +
pmaddwd (two instructions; the byte pairs' sums fit int16 for 4-bit weights, 2 x 15 x 128 < 2^15; 8-bit ones go in
as signed bytes, see dot_bytes), on the widest vectors the CPU has (64 bytes with AVX-512, 32 with AVX2 or
AVX-VNNI, else 16). Every choice gives the same integers, so a kernel's results do not depend on which the CPU has."""

from __future__ import annotations

from dataclasses import dataclass

import tvm
from tvm import tirx
from tvm.script import tirx as T

VNNI, MADDUBS = "vnni", "maddubs"
_VNNI = {16: "llvm.x86.avx512.vpdpbusd.128", 32: "llvm.x86.avx512.vpdpbusd.256", 64: "llvm.x86.avx512.vpdpbusd.512"}
_MADDUBS = {  # bytes -> (u8 x s8 pair sums into int16, int16 pair sums into int32)
    16: ("llvm.x86.ssse3.pmadd.ub.sw.128", "llvm.x86.sse2.pmadd.wd"),
    32: ("llvm.x86.avx2.pmadd.ub.sw", "llvm.x86.avx2.pmadd.wd"),
    64: ("llvm.x86.avx512.pmaddubs.w.512", "llvm.x86.avx512.pmaddw.d.512"),
}
_SIGN = {16: "llvm.x86.ssse3.psign.b.128", 32: "llvm.x86.avx2.psign.b"}  # a byte negated where another is < 0


@dataclass(frozen=True)
class Int8Dot:
    """An int8 dot-product instruction (VNNI or MADDUBS), the widest vector, in bytes, it runs on here, and whether
    the CPU also has AMX's int8 tiles (many-row calls: qlinear_amx) and its bfloat16 ones (prompt-sized calls of
    grouped weights: qlinear_amx_bf16)."""

    kind: str
    widest: int
    amx: bool = False
    amx_bf16: bool = False


def int8_dot_product(target: tvm.target.Target) -> Int8Dot | None:
    """The target CPU's instruction and widest vector; None off x86 (or an x86 CPU older than SSSE3)."""
    if target.kind.name != "llvm":
        return None
    features = {str(f) for f in tvm.target.codegen.llvm_get_cpu_features(target)}
    if {"avx512vnni", "avx512vl"} <= features:
        amx = {"amx-tile", "amx-int8"} <= features
        return Int8Dot(VNNI, 64, amx=amx, amx_bf16=amx and "amx-bf16" in features)
    if "avxvnni" in features:
        return Int8Dot(VNNI, 32)
    if "ssse3" not in features:
        return None
    return Int8Dot(MADDUBS, 64 if "avx512bw" in features else 32 if "avx2" in features else 16)


def dot_u8_s8(
    kind: str, acc: tirx.PrimExpr, unsigned: tirx.PrimExpr, signed: tirx.PrimExpr, width: int
) -> tirx.PrimExpr:
    """acc (int32 x width/4) + the sums of each four adjacent products of `unsigned` (uint8 x width) and `signed`
    (int8 x width)."""
    lanes = f"int32x{width // 4}"
    if kind == VNNI:
        if tvm.target.codegen.llvm_version_major() < 22:  # LLVM 22 types the byte operands as bytes
            unsigned, signed = T.reinterpret(lanes, unsigned), T.reinterpret(lanes, signed)
        return T.call_llvm_pure_intrin(lanes, _VNNI[width], acc, unsigned, signed)
    return _widened(acc, _byte_pairs(unsigned, signed, width), width)


def _byte_pairs(unsigned: tirx.PrimExpr, signed: tirx.PrimExpr, width: int) -> tirx.PrimExpr:
    """pmaddubsw: int16 x width/2, the sums of each two adjacent products (saturated)."""
    return T.call_llvm_pure_intrin(f"int16x{width // 2}", _MADDUBS[width][0], unsigned, signed)


def _widened(acc: tirx.PrimExpr, pairs: tirx.PrimExpr, width: int) -> tirx.PrimExpr:
    """acc + pmaddwd(pairs, 1): each two adjacent int16 sums added into an int32 lane."""
    ones = T.broadcast(T.int16(1), width // 2)
    return acc + T.call_llvm_pure_intrin(f"int32x{width // 4}", _MADDUBS[width][1], pairs, ones)


def dot_nibbles(
    kind: str, acc: tirx.PrimExpr, weights: tirx.PrimExpr, low_x: tirx.PrimExpr, high_x: tirx.PrimExpr, width: int
) -> tirx.PrimExpr:
    """acc + the four-product sums of each weight byte's low nibble against `low_x` and its high nibble against
    `high_x` (int8 x width, in [-127, 127]); without VNNI the two pmaddubsw sums are added as int16 (2 x 2 x 15 x 127
    < 2^15), so one pmaddwd widens both."""
    low = weights & T.broadcast(T.uint8(15), width)
    high = weights >> T.broadcast(T.uint8(4), width)
    if kind == VNNI:
        return dot_u8_s8(kind, dot_u8_s8(kind, acc, low, low_x, width), high, high_x, width)
    return _widened(acc, _byte_pairs(low, low_x, width) + _byte_pairs(high, high_x, width), width)


def byte_offset(kind: str, width: int) -> int:
    """What dot_bytes subtracts from each unsigned byte before multiplying: 128 where it multiplies signed bytes."""
    return 128 if kind == MADDUBS and width in _SIGN else 0


def dot_bytes(
    kind: str, acc: tirx.PrimExpr, unsigned: tirx.PrimExpr, signed: tirx.PrimExpr, width: int
) -> tirx.PrimExpr:
    """acc + the sums of each four adjacent products of (`unsigned` - byte_offset) and `signed` (in [-127, 127]), for
    unsigned bytes of any value: pmaddubsw's int16 pair sums would saturate on them (2 x 255 x 127). Without VNNI,
    the byte less 128 goes in as |w| (unsigned) times x with w's sign (psignb; 2 x 128 x 127 < 2^15); on 64-byte
    vectors, which have no psignb, as its low nibble plus 16 x its high one."""
    if kind == VNNI:
        return dot_u8_s8(kind, acc, unsigned, signed, width)
    if width in _SIGN:
        bytes_type = f"int8x{width}"
        centred = T.reinterpret(bytes_type, unsigned ^ T.broadcast(T.uint8(128), width))  # w - 128
        magnitude = T.call_llvm_pure_intrin(bytes_type, _SIGN[width], centred, centred)  # -128 stays 0x80: 128
        signs = T.call_llvm_pure_intrin(bytes_type, _SIGN[width], signed, centred)
        return dot_u8_s8(kind, acc, T.reinterpret(f"uint8x{width}", magnitude), signs, width)
    low = dot_u8_s8(kind, acc, unsigned & T.broadcast(T.uint8(15), width), signed, width)
    high = dot_u8_s8(
        kind, T.broadcast(T.int32(0), width // 4), unsigned >> T.broadcast(T.uint8(4), width), signed, width
    )
    return low + high * T.broadcast(T.int32(16), width // 4)
