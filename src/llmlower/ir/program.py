"""Program: a flat torch.fx GraphModule captured by torch.export, with its ModelSpec and signature.

Inputs and outputs are named; dimension names ("batch", "tokens", "context") say which sizes are dynamic.
Passes rewrite `graph_module` in place and record themselves in `history`. A pass that adds nodes without
shape metadata marks the program stale; a later pass that reads shapes calls `with_fresh_meta()`, which
runs torch.export again (seconds on a real model, so only when someone needs it).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
import torch.fx

from ..spec import ModelSpec
from ..step_io import (
    BLOCK_TABLES,
    INPUT_IDS,
    INPUT_LENS,
    LOGITS_INDICES,
    PAST_LENS,
    POSITION_IDS,
    STATE_SLOTS,
    KVLayout,
)
from ..step_io import LOGITS as LOGITS  # re-exported: the program's names are the step interface's
from ..step_io import cache_names as cache_names

_MAX_BATCH = 4096
_MAX_PACKED_TOKENS = 1 << 16  # a PAGED step packs every sequence's tokens into one row

# Checks torch.export leaves in the graph; they guard the capture, not the computation.
ASSERT_TARGETS = {
    torch.ops.aten._assert_tensor_metadata.default,
    torch.ops.aten._assert_scalar.default,
    torch.ops.aten.sym_constrain_range.default,
    torch.ops.aten.sym_constrain_range_for_size.default,
}


@dataclass(frozen=True)
class TensorSpec:
    """A named graph input or output; `shape` holds dimension names for dynamic sizes, ints for fixed."""

    name: str
    dtype: str
    shape: tuple[str | int, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}


@dataclass(frozen=True)
class PassRecord:
    """What one pass did: its options, graph statistics before and after, and its verification error."""

    name: str
    options: dict[str, Any]
    stats: dict[str, Any]
    seconds: float
    max_error: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """As JSON data (an artifact's manifest lists the pipeline this way)."""
        return asdict(self)


@dataclass
class Program:
    graph_module: torch.fx.GraphModule
    spec: ModelSpec
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    history: list[PassRecord] = field(default_factory=list)
    fresh_meta: bool = True  # every node carries torch.export's shape metadata

    @property
    def input_names(self) -> list[str]:
        return [t.name for t in self.inputs]

    @property
    def output_names(self) -> list[str]:
        return [t.name for t in self.outputs]

    @property
    def has_kv_cache(self) -> bool:
        return PAST_LENS in self.input_names

    @property
    def kv_layout(self) -> KVLayout | None:
        """SLOTS after kv_cache, PAGED after paged_attention, None before any KV cache."""
        if BLOCK_TABLES in self.input_names:
            return KVLayout.PAGED
        return KVLayout.SLOTS if self.has_kv_cache else None

    @property
    def block_size(self) -> int:
        """Tokens per KV block of a PAGED program (the pools' second dimension; a model without attention, whose
        blocks only size its state rows, the paged_attention pass's option)."""
        pools = [t for t in self.inputs if len(t.shape) == 4 and t.shape[0] == "pool"]
        if pools:
            return int(pools[0].shape[1])
        paged = [record.stats["block_size"] for record in self.history if record.name == "paged_attention"]
        if not paged:
            raise ValueError("the program has no KV block pools (apply the paged_attention pass)")
        return int(paged[-1])

    @torch.no_grad()
    def __call__(self, **tensors: torch.Tensor) -> dict[str, torch.Tensor]:
        """Run the graph eagerly on named inputs; returns the named outputs."""
        missing = [n for n in self.input_names if n not in tensors]
        if missing:
            raise TypeError(f"program inputs missing: {', '.join(missing)}")
        results = self.graph_module(*(tensors[n] for n in self.input_names))
        return dict(zip(self.output_names, results, strict=True))

    def with_signature(self, inputs: list[TensorSpec], outputs: list[TensorSpec]) -> Program:
        """The program with a new signature; its new nodes have no metadata yet."""
        return replace(self, inputs=inputs, outputs=outputs, fresh_meta=False)

    def with_fresh_meta(self) -> Program:
        """This program if its metadata is fresh, else a re-exported copy."""
        return self if self.fresh_meta else self.reexport()

    def export(self, fixed: dict[str, int] | None = None) -> torch.export.ExportedProgram:
        """torch.export of the current graph, dynamic in every named dimension but those `fixed` to a size
        (e.g. {"tokens": 1}: a decode-only graph)."""
        fixed = fixed or {}
        paged = self.kv_layout is KVLayout.PAGED
        max_tokens = _MAX_PACKED_TOKENS if paged else self.spec.max_positions
        dims = {
            "batch": torch.export.Dim("batch", min=1, max=_MAX_BATCH),
            "tokens": torch.export.Dim("tokens", min=1, max=max_tokens),
            "context": torch.export.Dim("context", min=1, max=self.spec.max_positions),
            "seqs": torch.export.Dim("seqs", min=1, max=_MAX_BATCH),
            "blocks": torch.export.Dim("blocks", min=1, max=self.spec.max_positions),
            "pool": torch.export.Dim("pool", min=2, max=1 << 24),
            "slots": torch.export.Dim("slots", min=2, max=1 << 16),  # a PAGED recurrent state's rows
            "logits": torch.export.Dim("logits", min=1, max=_MAX_PACKED_TOKENS),
        }
        sizes = {"batch": 2, "tokens": 5, "context": 7, "seqs": 2, "blocks": 3, "pool": 7} | fixed
        if paged:
            example = paged_example_inputs(self, sizes["seqs"], sizes["tokens"], sizes["blocks"], sizes["pool"])
        else:
            example = example_inputs(self, sizes["batch"], sizes["tokens"], sizes["context"])
        args = tuple(example[t.name] for t in self.inputs)
        dynamic = tuple(
            {axis: dims[d] for axis, d in enumerate(t.shape) if isinstance(d, str) and d not in fixed}
            for t in self.inputs
        )
        with torch.no_grad():
            return torch.export.export(self.graph_module, args, dynamic_shapes=dynamic, strict=False)

    def reexport(self) -> Program:
        """A copy whose graph comes from a fresh torch.export (fresh node metadata)."""
        return replace(self, graph_module=flat_graph_module(self.export(), strip_asserts=True), fresh_meta=True)

    def parameters_numel(self) -> int:
        return sum(t.numel() for t in _constants(self.graph_module))

    def parameters_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in _constants(self.graph_module))

    def graph_stats(self) -> dict[str, int]:
        nodes = list(self.graph_module.graph.nodes)
        return {
            "nodes": sum(n.op == "call_function" for n in nodes),
            "parameters": self.parameters_numel(),
            "parameter_bytes": self.parameters_bytes(),
        }


def _constants(gm: torch.fx.GraphModule) -> list[torch.Tensor]:
    """The distinct tensors the graph reads through get_attr (weights and folded constants)."""
    seen: dict[int, torch.Tensor] = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value = fetch_attr(gm, node.target)
            if isinstance(value, torch.Tensor):
                seen[id(value)] = value
    return list(seen.values())


def fetch_attr(gm: torch.nn.Module, target: str) -> Any:
    value: Any = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value


def flat_graph_module(ep: torch.export.ExportedProgram, strip_asserts: bool = False) -> torch.fx.GraphModule:
    """The exported graph as a GraphModule with positional inputs and a flat tuple of outputs; with
    `strip_asserts`, without the checks export adds (canonicalize removed them once already)."""
    gm = ep.module()
    for node in list(gm.graph.nodes):
        guard = node.op == "call_module" and node.target == "_guards_fn"
        if guard or (strip_asserts and node.op == "call_function" and node.target in ASSERT_TARGETS):
            gm.graph.erase_node(node)
    gm.graph._codegen = torch.fx.graph.CodeGen()
    gm._forward_pre_hooks.clear()  # export's input-spec check, which the flat signature no longer matches
    gm.delete_all_unused_submodules()
    gm.recompile()
    return gm


def example_inputs(
    program: Program, batch: int, tokens: int, context: int, past_max: int = 0, seed: int = 0
) -> dict[str, torch.Tensor]:
    """Random inputs for every input of `program`: right-padded sequences, each with a random past length
    in [0, past_max] and a random count of new tokens in [1, tokens]; caches filled with noise."""
    gen = torch.Generator().manual_seed(seed)
    past = torch.randint(0, past_max + 1, (batch,), generator=gen)
    lens = torch.randint(1, tokens + 1, (batch,), generator=gen)
    lens[0] = tokens  # at least one sequence uses every token position
    values: dict[str, torch.Tensor] = {
        INPUT_IDS: torch.randint(0, program.spec.vocab_size, (batch, tokens), generator=gen),
        POSITION_IDS: past[:, None] + torch.arange(tokens)[None, :],
        PAST_LENS: past,
        INPUT_LENS: lens,
        LOGITS_INDICES: torch.arange(batch) * tokens + lens - 1,  # each sequence's last token
    }
    sizes = {"batch": batch, "tokens": tokens, "context": context}
    for t in program.inputs:
        if t.name not in values:  # a cache or any other float input: noise of its declared shape
            shape = tuple(sizes[d] if isinstance(d, str) else d for d in t.shape)
            values[t.name] = torch.randn(shape, generator=gen).to(getattr(torch, t.dtype))
    return {t.name: values[t.name] for t in program.inputs}


def paged_example_inputs(
    program: Program, seqs: int, tokens: int, blocks: int, pool: int, past_max: int | None = None, seed: int = 0
) -> dict[str, torch.Tensor]:
    """Random inputs for a PAGED program: `tokens` new tokens packed over `seqs` sequences (each at least one),
    random past lengths (up to past_max) that fit `blocks` blocks each, block tables naming random blocks of a
    pool of `pool` blocks, pools filled with noise."""
    if not 0 < seqs <= tokens:
        raise ValueError(f"{tokens} packed tokens cannot hold {seqs} sequences")
    gen = torch.Generator().manual_seed(seed)
    lens = torch.ones(seqs, dtype=torch.int64)
    lens += torch.bincount(torch.randint(0, seqs, (tokens - seqs,), generator=gen), minlength=seqs)
    room = blocks * program.block_size - lens
    if (room < 0).any():
        raise ValueError(f"{blocks} blocks of {program.block_size} tokens cannot hold {int(lens.max())} new tokens")
    limit = room if past_max is None else room.clamp(max=past_max)
    past = (torch.rand(seqs, generator=gen) * (limit + 1)).long()
    sequence = torch.repeat_interleave(torch.arange(seqs), lens)
    positions = past[sequence] + torch.arange(tokens) - (torch.cumsum(lens, 0) - lens)[sequence]
    values: dict[str, torch.Tensor] = {
        INPUT_IDS: torch.randint(0, program.spec.vocab_size, (1, tokens), generator=gen),
        POSITION_IDS: positions[None],
        PAST_LENS: past,
        INPUT_LENS: lens,
        BLOCK_TABLES: torch.randint(0, pool, (seqs, blocks), generator=gen),
        LOGITS_INDICES: torch.cumsum(lens, 0) - 1,  # each sequence's last token
        STATE_SLOTS: torch.randperm(seqs + 2, generator=gen)[:seqs],  # distinct rows of a state pool
    }
    sizes = {"tokens": tokens, "seqs": seqs, "blocks": blocks, "pool": pool, "slots": seqs + 2}
    for t in program.inputs:
        if t.name not in values:  # a pool or any other float input: noise of its declared shape
            shape = tuple(sizes[d] if isinstance(d, str) else d for d in t.shape)
            values[t.name] = torch.randn(shape, generator=gen).to(getattr(torch, t.dtype))
    return {t.name: values[t.name] for t in program.inputs}
