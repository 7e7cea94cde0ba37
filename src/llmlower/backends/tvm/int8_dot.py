"""The x86 instruction that multiplies unsigned bytes by signed ones and adds each four adjacent products into one
int32 lane, chosen from what the target CPU has: VNNI's vpdpbusd (AVX-512 VNNI, or AVX-VNNI), else pmaddubsw +
pmaddwd (two instructions; the byte pairs' sums fit int16 for 4-bit weights, 2 x 15 x 128 < 2^15, so 8-bit ones go
in as two nibbles), on the widest vectors the CPU has (64 bytes with AVX-512, 32 with AVX2 or AVX-VNNI, else 16).
Every choice gives the same integers, so a kernel's results do not depend on which the CPU has."""

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
    pairs_of_bytes, pairs_of_words = _MADDUBS[width]
    pairs = T.call_llvm_pure_intrin(f"int16x{width // 2}", pairs_of_bytes, unsigned, signed)
    return acc + T.call_llvm_pure_intrin(lanes, pairs_of_words, pairs, T.broadcast(T.int16(1), width // 2))


def dot_bytes(
    kind: str, acc: tirx.PrimExpr, unsigned: tirx.PrimExpr, signed: tirx.PrimExpr, width: int
) -> tirx.PrimExpr:
    """dot_u8_s8 for unsigned bytes of any value: pmaddubsw's int16 pair sums would saturate on them (2 x 255 x 128),
    so without VNNI each byte goes in as its low nibble plus 16 x its high one, two products that fit."""
    if kind == VNNI:
        return dot_u8_s8(kind, acc, unsigned, signed, width)
    low = dot_u8_s8(kind, acc, unsigned & T.broadcast(T.uint8(15), width), signed, width)
    high = dot_u8_s8(
        kind, T.broadcast(T.int32(0), width // 4), unsigned >> T.broadcast(T.uint8(4), width), signed, width
    )
    return low + high * T.broadcast(T.int32(16), width // 4)
