"""The x86 instruction that multiplies 16 unsigned bytes by 16 signed ones and adds each four adjacent products into
one of four int32 lanes, chosen from what the target CPU has: VNNI's vpdpbusd (AVX-512 VNNI with VL, or AVX-VNNI),
else SSSE3's pmaddubsw + SSE2's pmaddwd (two instructions; the byte pairs' sums fit int16 for 4-bit weights,
2 x 15 x 127 < 2^15, not for 8-bit ones). Both give the same integers, so a kernel's results do not depend on which
the CPU has."""

from __future__ import annotations

import tvm
from tvm import tirx
from tvm.script import tirx as T

VNNI, MADDUBS = "vnni", "maddubs"


def int8_dot_product(target: tvm.target.Target) -> str | None:
    """VNNI or MADDUBS where the target's CPU has it; None off x86 (or an x86 CPU older than SSSE3)."""
    if target.kind.name != "llvm":
        return None
    features = {str(f) for f in tvm.target.codegen.llvm_get_cpu_features(target)}
    if {"avx512vnni", "avx512vl"} <= features or "avxvnni" in features:
        return VNNI
    return MADDUBS if "ssse3" in features else None


def dot_u8_s8(kind: str, acc: tirx.PrimExpr, unsigned: tirx.PrimExpr, signed: tirx.PrimExpr) -> tirx.PrimExpr:
    """acc (int32x4) + the sums of each four adjacent products of `unsigned` (uint8x16) and `signed` (int8x16)."""
    if kind == VNNI:
        if tvm.target.codegen.llvm_version_major() < 22:  # LLVM 22 types the byte operands as bytes
            unsigned, signed = T.reinterpret("int32x4", unsigned), T.reinterpret("int32x4", signed)
        return T.call_llvm_pure_intrin("int32x4", "llvm.x86.avx512.vpdpbusd.128", acc, unsigned, signed)
    pairs = T.call_llvm_pure_intrin("int16x8", "llvm.x86.ssse3.pmadd.ub.sw.128", unsigned, signed)
    return acc + T.call_llvm_pure_intrin("int32x4", "llvm.x86.sse2.pmadd.wd", pairs, T.broadcast(T.int16(1), 8))
