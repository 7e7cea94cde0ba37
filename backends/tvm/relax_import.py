"""Program -> Relax IRModule with TVM's paged KV cache: `prefill` and `decode` step functions and
`create_kv_cache`, the weights kept out of the module as parameters.

The step graph is the Program with logits as its only output: the per-layer cache tensors become one
object parameter, TVM's paged KV cache, which the attention converters call (lowerings.py). The cache takes
a step's tokens ragged, so a step also gets `ragged_rows` (the flat index of each real token in the padded
[batch * tokens] layout) and `padded_rows` (for each padded position, the ragged row it reads back).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.fx
import tvm
from tvm import relax, tirx
from tvm.relax.frontend.nn.llm.kv_cache import RopeMode, TIRPagedKVCache
from tvm.relax.frontend.torch.exported_program_translator import ExportedProgramImporter

from ...ir import ATTENTION, QKV_ATTENTION
from ...ir.program import INPUT_IDS, LOGITS, POSITION_IDS, Program, fetch_attr
from ...spec import ModelSpec
from .lowerings import TvmLoweringError, convert_map

KV_CACHE, RAGGED_ROWS, PADDED_ROWS = "paged_kv_cache", "ragged_rows", "padded_rows"
STEP_FUNCTIONS = ("prefill", "decode")
CACHE_INPUT = re.compile(r"[kv]_cache_\d+")
CACHE_SHAPE_VARS = ("max_batch_size", "max_total_seq_len", "prefill_chunk_size", "page_size", "support_sliding")
ROPE_TOLERANCE = 2e-3  # float32 angles at 8k positions differ by ~1e-3 between implementations


@dataclass
class RelaxModel:
    """The IRModule to compile, its weights in the order the step functions take them, and how rope is done."""

    module: tvm.IRModule
    params: dict[str, np.ndarray]
    cache_rotates: bool

    @property
    def inputs(self) -> list[str]:
        """The step functions' data inputs, in call order (the weights follow them)."""
        prefill = self.module["prefill"]
        return [v.name for v in prefill.params[: int(prefill.attrs["num_input"])]]


class StepImporter(ExportedProgramImporter):
    """from_exported_program's importer with the KV-cache tensors replaced by TVM's paged KV cache object
    and the ragged-row inputs added; the converters read both from here."""

    def __init__(self, spec: ModelSpec, cache_rotates: bool, kernel_prefix: str) -> None:
        super().__init__()
        self.spec, self.cache_rotates, self.kernel_prefix = spec, cache_rotates, kernel_prefix
        self.kv_cache = relax.Var(KV_CACHE, relax.ObjectType())

    def create_input_vars(self, exported_program: torch.export.ExportedProgram):
        params, users, ranges = super().create_input_vars(exported_program)
        for node in exported_program.graph.find_nodes(op="placeholder"):
            if CACHE_INPUT.fullmatch(node.name):
                self.env[node] = self.kv_cache
                del users[node.name]
        batch, tokens = users[INPUT_IDS].ty.shape
        self.position_ids = users[POSITION_IDS]
        self.ragged_rows = relax.Var(RAGGED_ROWS, relax.TensorType([tirx.Var("ragged_tokens", "int64")], "int64"))
        self.padded_rows = relax.Var(PADDED_ROWS, relax.TensorType([batch * tokens], "int64"))
        users.update({KV_CACHE: self.kv_cache, RAGGED_ROWS: self.ragged_rows, PADDED_ROWS: self.padded_rows})
        return params, users, ranges


def step_program(program: Program) -> Program:
    """A copy of the program that returns only the logits and holds every weight as a Parameter (so
    from_exported_program keeps them all as function parameters instead of baking them in as constants)."""
    graph = torch.fx.Graph()
    out = graph.graph_copy(program.graph_module.graph, {})
    logits = out[program.output_names.index(LOGITS)]
    graph.output((logits,))
    gm = torch.fx.GraphModule(program.graph_module, graph)
    gm.graph.eliminate_dead_code()
    for node in gm.graph.find_nodes(op="get_attr"):
        *path, name = node.target.split(".")
        owner = fetch_attr(gm, ".".join(path)) if path else gm
        value = getattr(owner, name)
        if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
            delattr(owner, name)
            owner.register_parameter(name, torch.nn.Parameter(value, requires_grad=False))
    gm.recompile()
    outputs = [program.outputs[program.output_names.index(LOGITS)]]
    return replace(program, graph_module=gm, outputs=outputs, fresh_meta=False)


def check_lowerable(exported: torch.export.ExportedProgram, converters: dict) -> None:
    """Fail before importing when a node has neither a converter of ours nor one of TVM's, naming it."""
    known = set(ExportedProgramImporter().convert_map) | set(converters)
    for node in exported.graph.nodes:
        if node.op == "call_function" and node.target.__name__ not in known:
            raise TvmLoweringError(f"the TVM backend cannot lower node {node.name} (op {node.target})")


def cache_can_rotate(program: Program) -> bool:
    """Whether TVM's cache can apply rope itself: every attention is a qkv_attention whose rotary tables
    are plain `rope_theta` ones over the whole head (what the cache's kernels compute)."""
    nodes = program.graph_module.graph.find_nodes
    rope = program.spec.rope or {}
    if nodes(op="call_function", target=ATTENTION.overload) or rope.get("rope_type", "default") != "default":
        return False
    fused = nodes(op="call_function", target=QKV_ATTENTION.overload)
    if not fused or "rope_theta" not in rope:
        return False
    head_dim = program.spec.head_dim
    inv_freq = 1.0 / rope["rope_theta"] ** (np.arange(0, head_dim, 2) / head_dim)
    for node in fused:
        cos = fetch_attr(program.graph_module, node.args[5].target).float().numpy()
        sin = fetch_attr(program.graph_module, node.args[6].target).float().numpy()
        if cos.shape[1] != head_dim // 2:
            return False
        angles = np.arange(cos.shape[0])[:, None] * inv_freq[None, :]
        if max(np.abs(cos - np.cos(angles)).max(), np.abs(sin - np.sin(angles)).max()) > ROPE_TOLERANCE:
            return False
    return True


def _create_kv_cache(builder: relax.BlockBuilder, spec: ModelSpec, cache_rotates: bool, target: tvm.target.Target):
    """create_kv_cache(shape [max_batch, max_total_tokens, prefill_chunk, page_size, sliding]) -> the cache,
    with TVM's TIR attention kernels for `target` added to the module."""
    sizes = [tirx.Var(name, "int64") for name in CACHE_SHAPE_VARS]
    theta = (spec.rope or {}).get("rope_theta", 10000.0)
    with builder.function("create_kv_cache", [relax.Var("sizes", relax.ShapeType(sizes))]):
        cache = TIRPagedKVCache(
            attn_kind="mha",
            max_batch_size=sizes[0],
            max_total_seq_len=sizes[1],
            prefill_chunk_size=sizes[2],
            page_size=sizes[3],
            support_sliding_window=sizes[4],
            layer_partition=relax.ShapeExpr([0, spec.num_layers]),
            num_hidden_layers=spec.num_layers,
            num_attention_heads=spec.num_heads,
            num_key_value_heads=spec.num_kv_heads,
            qk_head_dim=spec.head_dim,
            v_head_dim=spec.head_dim,
            mla_original_qk_head_dim=0,
            mla_original_v_head_dim=0,
            rope_mode=RopeMode.NORMAL if cache_rotates else RopeMode.NONE,
            rope_scale=1,
            rope_theta=theta,
            rope_scaling={},
            rope_ext_factors=relax.prim_value(0),
            rotary_dim=spec.head_dim,
            enable_disaggregation=False,
            dtype=spec.dtype,
            target=target,
        )
        builder.emit_func_output(cache._expr)


def _prepare(exported: torch.export.ExportedProgram) -> None:
    """Rewrite what TVM's importer cannot take: negative slice dims (its dynamic-shape slice wants positive
    ones), and the batch size read off a KV-cache tensor (the cache becomes an object; input_ids has it too)."""
    graph = exported.graph
    for node in graph.find_nodes(op="call_function", target=torch.ops.aten.slice.Tensor):
        if len(node.args) > 1 and node.args[1] < 0:
            node.args = (node.args[0], node.args[1] + node.meta["val"].dim(), *node.args[2:])
    input_ids = next(n for n in graph.find_nodes(op="placeholder") if n.name == INPUT_IDS)
    for node in graph.find_nodes(op="call_function", target=torch.ops.aten.sym_size.int):
        source, dim = node.args
        if CACHE_INPUT.fullmatch(source.name):
            if dim != 0:
                raise TvmLoweringError(f"node {node.name} reads dimension {dim} of the KV cache {source.name}")
            node.args = (input_ids, 0)


def _import(
    step: Program, cache_rotates: bool, kernel_prefix: str, fixed: dict[str, int] | None = None
) -> tuple[tvm.IRModule, relax.Function]:
    """One step function imported from a fresh export (with `fixed` sizes); returns its kernels (named with
    `kernel_prefix`, so two imports' kernels can share a module) and the function."""
    converters = convert_map()
    exported = step.export(fixed).run_decompositions()
    _prepare(exported)
    check_lowerable(exported, converters)
    importer = StepImporter(step.spec, cache_rotates, kernel_prefix)
    module = importer.from_exported_program(exported, True, True, False, converters)
    kernels = tvm.IRModule({gv: f for gv, f in module.functions.items() if gv.name_hint != "main"})
    return kernels, module["main"]


def to_relax(program: Program, target: tvm.target.Target) -> RelaxModel:
    """The Relax module of `program` for `target` (whose attention kernels the cache needs): `prefill` for any
    number of tokens per sequence, `decode` for one (its kernels specialised to that shape)."""
    if program.spec.sliding_window:
        raise TvmLoweringError(
            f"the TVM backend does not lower sliding-window attention yet (model {program.spec.architecture}, "
            f"sliding_window {program.spec.sliding_window})"
        )
    step = step_program(program)
    cache_rotates = cache_can_rotate(program)
    kernels, prefill = _import(step, cache_rotates, "")
    decode_kernels, decode = _import(step, cache_rotates, "decode_", fixed={"tokens": 1})
    kernels.update(decode_kernels)
    names = [p.name for p in prefill.params[int(prefill.attrs["num_input"]) :]]
    params = {name: tensor.numpy() for name, tensor in zip(names, prefill.attrs["params"], strict=True)}
    builder = relax.BlockBuilder(kernels)
    for name, function in zip(STEP_FUNCTIONS, (prefill, decode), strict=True):
        # no tir_var_upper_bound: torch.export's bounds (4096 sequences x the whole context) would make the VM
        # plan every buffer for that size; without them buffers are sized per call and pooled
        function = function.without_attr("params").without_attr("tir_var_upper_bound")
        builder.add_func(function.with_attr("global_symbol", name), name)
    _create_kv_cache(builder, program.spec, cache_rotates, target)
    return RelaxModel(builder.get(), params, cache_rotates)
