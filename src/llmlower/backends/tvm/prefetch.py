"""Software prefetch for the CPU kernels: a hint (never a fault) that brings a cache line in before its load, for
reads the hardware prefetchers pick up too late (short runs a stride apart, rows another thread streams next)."""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

LINE_BYTES = 64  # a cache line
L2 = 2  # llvm.prefetch's locality: 3 keeps the line in L1 too, 2 (prefetcht1) in L2 and below


def prefetch(element: tirx.BufferLoad, locality: int = L2) -> tirx.PrimExpr:
    """A read prefetch of the line holding `element` (a buffer load, e.g. pool[block, t, head, 0])."""
    return T.call_llvm_intrin(
        "void", "llvm.prefetch.p0", T.address_of(element), T.int32(0), T.int32(locality), T.int32(1)
    )
