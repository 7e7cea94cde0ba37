"""The llm op set's registry: one OpDef per op, holding its torch op, a summary and its cost formula."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

NAMESPACE = "llmlower"


@dataclass(frozen=True)
class Cost:
    """Work of one op invocation: floating-point operations and bytes moved to and from memory."""

    flops: int
    bytes: int

    def __add__(self, other: Cost) -> Cost:
        return Cost(self.flops + other.flops, self.bytes + other.bytes)


@dataclass(frozen=True)
class OpDef:
    """An op of the set: `op` is the torch.library op (reference + fake implementation registered)."""

    name: str
    op: torch._ops.OpOverloadPacket
    summary: str
    cost: Callable[..., Cost]

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
