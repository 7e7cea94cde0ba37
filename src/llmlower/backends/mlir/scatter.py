"""aten.scatter as one-hot compares and selects: torch-mlir lowers scatter to a TMTensor op, which the linalg
pipeline and the runtime's MLIR context do not have (DeepSeek's router builds its group mask with scatter_);
compares against an arange and `where` are plain linalg. One select per index along `dim`: a router's top-k."""

from __future__ import annotations

import torch


def scatter_by_select(x: torch.Tensor, dim: int, index: torch.Tensor, src: torch.Tensor | float) -> torch.Tensor:
    """torch.scatter(x, dim, index, src) for an index as large as x in every other dimension: entry k of index
    along `dim` puts src (its own entry k, or the scalar) where its position matches, later ks winning (torch
    leaves repeated indices' winner open)."""
    dim = dim % x.dim()
    positions = torch.arange(x.shape[dim], device=x.device)
    work, index = x.movedim(dim, -1), index.movedim(dim, -1)
    values = src.movedim(dim, -1) if isinstance(src, torch.Tensor) else None
    for k in range(index.shape[-1]):
        chosen = values[..., k : k + 1] if values is not None else torch.full_like(work[..., :1], src)
        work = torch.where(positions == index[..., k : k + 1], chosen, work)
    return work.movedim(-1, dim)


SCATTER_DECOMPOSITION = {
    torch.ops.aten.scatter.value: scatter_by_select,
    torch.ops.aten.scatter.src: scatter_by_select,
}
