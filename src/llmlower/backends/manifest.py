"""The part of an artifact's manifest every backend writes: versions, model spec, pipeline, backend, target, and
the runtime executor that runs it."""

from __future__ import annotations

from typing import Any

from .. import __version__
from ..ir.program import Program
from ..step_io import KVLayout, cache_layer
from .registry import get_backend


def program_manifest(program: Program, backend: str, target: str) -> dict[str, Any]:
    """Manifest entries describing what was compiled, for where and what runs it (`executor`: the backend's
    runtime executor for the program's KV layout, which Engine.load imports); backends add their files and layout."""
    return {
        "toolkit_version": __version__,
        "backend": backend,
        "target": target,
        "executor": get_backend(backend).runtime_executor(program.kv_layout),
        "dtype": program.spec.dtype,
        "spec": program.spec.to_dict(),
        "pipeline": [record.to_dict() for record in program.history],
    }


def cache_dtype(program: Program) -> str:
    """The dtype the program's KV cache is kept in: its cache inputs' (int8 after the kv_cache_dtype pass), else
    the model's."""
    dtypes = {t.dtype for t in program.inputs if cache_layer(t.name) is not None}
    return dtypes.pop() if len(dtypes) == 1 else program.spec.dtype


def kv_layout_manifest(program: Program) -> dict[str, Any]:
    """The artifact's KV layout: SLOTS caches [slots, kv_heads, context, head_dim] (the block size is the
    runtime's choice), or PAGED pools [num_blocks, block_size, kv_heads, head_dim] (fixed when compiling), and the
    dtype the cache is kept in (the model's, or int8: the kv_cache_dtype pass)."""
    spec = program.spec
    paged = program.kv_layout is KVLayout.PAGED
    layout = {
        "kind": program.kv_layout.value,
        "shape": ["num_blocks", "block_size", "kv_heads", "head_dim"]
        if paged
        else ["slots", "kv_heads", "context", "head_dim"],
        "layers": spec.num_layers,
        "kv_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "dtype": cache_dtype(program),
    }
    if paged:
        layout["block_size"] = program.block_size
    return layout
