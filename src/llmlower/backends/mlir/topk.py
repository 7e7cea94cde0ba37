"""aten.topk as k rounds of max: torch-mlir lowers topk to a TMTensor sort, which the linalg pipeline and the
runtime's MLIR context do not have; max reductions and selects are plain linalg. k is a router's top-k: small."""

from __future__ import annotations

import torch


def topk_by_max(
    x: torch.Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.topk's values and indices (in order, first index on ties) by taking the largest remaining entry
    k times and masking it out."""
    last = x.dim() - 1
    work = x.movedim(dim, -1) if dim not in (-1, last) else x
    work = work if largest else -work
    positions = torch.arange(work.shape[-1], device=x.device)
    values, indices = [], []
    for _ in range(k):
        value, index = work.max(dim=-1, keepdim=True)
        values.append(value)
        indices.append(index)
        work = torch.where(positions == index, float("-inf"), work)
    value, index = torch.cat(values, dim=-1), torch.cat(indices, dim=-1)
    value = value if largest else -value
    if dim not in (-1, last):
        value, index = value.movedim(-1, dim), index.movedim(-1, dim)
    return value, index


TOPK_DECOMPOSITION = {torch.ops.aten.topk.default: topk_by_max}
