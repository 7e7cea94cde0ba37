"""The llm op set's registry: one OpDef per op, holding its torch op, a summary and its cost formula."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

NAMESPACE = "llmlower"


@dataclass(frozen=True)
class Cost:
    """Work of one op invocation: floating-point operations and bytes moved to and from memory (`bytes`, the
    total), of which `weight_bytes` are weights (packed bytes, scales and zeros when quantized) and
    `kv_read_bytes` / `kv_write_bytes` KV-cache traffic; the rest are activations."""

    flops: int
    bytes: int
    weight_bytes: int = 0
    kv_read_bytes: int = 0
    kv_write_bytes: int = 0

    def without_cache_traffic(self) -> Cost:
        """The same work without the cache's reads and writes (a captured op over a whole prompt, keeping no state)."""
        return Cost(self.flops, self.bytes - self.kv_read_bytes - self.kv_write_bytes, self.weight_bytes)

    @property
    def activation_bytes(self) -> int:
        return self.bytes - self.weight_bytes - self.kv_read_bytes - self.kv_write_bytes

    def __add__(self, other: Cost) -> Cost:
        return Cost(
            self.flops + other.flops,
            self.bytes + other.bytes,
            self.weight_bytes + other.weight_bytes,
            self.kv_read_bytes + other.kv_read_bytes,
            self.kv_write_bytes + other.kv_write_bytes,
        )


@dataclass(frozen=True)
class OpDef:
    """An op of the set: `op` is the torch.library op (reference + fake implementation registered);
    `reference` is that reference implementation itself when it traces to aten ops (no Python over data), so
    backends without a lowering of their own decompose the op with it (ir.decompositions); None when it loops
    over per-sequence lengths."""

    name: str
    op: torch._ops.OpOverloadPacket
    summary: str
    cost: Callable[..., Cost]
    reference: Callable[..., Any] | None = None

    @property
    def overload(self) -> torch._ops.OpOverload:
        return self.op.default


OPS: dict[str, OpDef] = {}


def register_op(opdef: OpDef) -> OpDef:
    """Add an op to the set; its name must be unique."""
    if opdef.name in OPS:
        raise ValueError(f"op {opdef.name!r} is already registered")
    OPS[opdef.name] = opdef
    return opdef


def op_of(target: object) -> OpDef | None:
    """The OpDef whose torch op is `target` (an FX node target), or None for any other op."""
    for opdef in OPS.values():
        if target is opdef.overload or target is opdef.op:
            return opdef
    return None
