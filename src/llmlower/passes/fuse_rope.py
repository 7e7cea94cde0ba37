"""fuse_rope: x * cos + rotate_half(x) * sin spelled in aten ops -> `rope(x, cos, sin)`."""

from __future__ import annotations

from typing import Any

import torch

from ..ir.program import Program
from ..ir.rope import ROPE
from .graph_utils import finish, replace_uses
from .patterns import find, last_dim
from .registry import Pass, register_pass

aten = torch.ops.aten
_END = 9223372036854775807  # slice to the end, as export spells it


def _rotate_half_pattern(x, cos, sin):
    first = aten.slice.Tensor(x, 3, 0, 8)
    second = aten.slice.Tensor(x, 3, 8, _END)
    rotated = aten.cat.default([aten.neg.default(second), first], -1)
    return aten.add.Tensor(aten.mul.Tensor(x, cos), aten.mul.Tensor(rotated, sin))


def _is_rotate_half(match, head_dim: int) -> bool:
    first, second = match.all(aten.slice.Tensor)
    half = head_dim // 2
    dims_ok = first.args[1] in (3, -1) and second.args[1] in (3, -1)
    bounds_ok = tuple(first.args[2:4]) == (0, half) and second.args[2] == half and second.args[3] >= head_dim
    return dims_ok and bounds_ok and match.node(aten.cat.default).args[1] in (-1, 3)


def fuse_rope(program: Program) -> tuple[Program, dict[str, Any]]:
    program = program.with_fresh_meta()
    gm = program.graph_module
    fused = 0
    for match in find(gm, _rotate_half_pattern):
        x, cos, sin = match.inputs
        head_dim = last_dim(gm, x)
        if head_dim is None or head_dim % 2 or not _is_rotate_half(match, head_dim):
            continue
        with gm.graph.inserting_before(match.outputs[0]):
            node = gm.graph.call_function(ROPE.overload, (x, cos, sin))
        replace_uses(match.outputs, [node])
        fused += 1
    finish(gm)
    return program, {"rope": fused}


register_pass(
    Pass(
        name="fuse_rope",
        summary="rotary embedding (rotate_half form) -> rope",
        explain=(
            "Matches x * cos + cat(-x[..., d/2:], x[..., :d/2]) * sin, the form transformers' "
            "apply_rotary_pos_emb takes for q and for k, and replaces it with llmlower::rope(x, cos, sin). "
            "The slice bounds must split the head dim in halves; partial or interleaved rotary and models "
            "with learned positions (GPT-2) are left unchanged."
        ),
        run=fuse_rope,
    )
)
