"""PAGED Program -> Relax IRModule: a `step` function for any number of packed tokens and `copy_blocks`, the
weights kept out of the module as parameters.

The step graph is the Program with logits as its only output. Its inputs stay the program's own (input_ids,
position_ids [1, tokens], past_lens, input_lens [seqs] and block_tables [seqs, blocks], int64) and the
per-layer block pools k_pool_<i> / v_pool_<i> [num_blocks, block_size, kv_heads, head_dim] are ordinary tensor
parameters: the runtime's block tables are the single source of truth, and the paged-attention kernels
(paged_kernels.py) append into the caller's pools in place. What the kernels want (int32 tables and lengths,
query_start = the exclusive cumsum of input_lens with a leading 0) is computed once inside the function.

`copy_blocks(k_pool_0, v_pool_0, k_pool_1, ..., src, dst)` copies blocks src[i] -> dst[i] (int32) in every
pool, in place, and returns the pools.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.fx
import tvm
from tvm import relax, tirx
from tvm.relax.frontend.torch.exported_program_translator import ExportedProgramImporter

from ...ir.program import LOGITS, Program, TensorSpec, fetch_attr
from ...step_io import BLOCK_TABLES, INPUT_LENS, PAST_LENS, POSITION_IDS, KVLayout, cache_layer
from .int8_dot import int8_dot_product
from .lowerings import TvmLoweringError, convert_map
from .paged_kernels import emit_copy_blocks

STEP, COPY_BLOCKS = "step", "copy_blocks"
COPY_INDICES = ("src", "dst")


@dataclass
class RelaxModel:
    """The IRModule to compile and its weights in the order the step function takes them."""

    module: tvm.IRModule
    params: dict[str, np.ndarray]
    accuracy_level: int  # 4 where grouped quantized matmuls run in int8 (qlinear_int8), else 0

    @property
    def inputs(self) -> list[str]:
        """The step function's data inputs, in call order (the weights follow them)."""
        step = self.module[STEP]
        return [v.name for v in step.params[: int(step.attrs["num_input"])]]


class StepImporter(ExportedProgramImporter):
    """from_exported_program's importer for a PAGED step: the converters read the target of the attention
    kernels, position_ids and the kernels' int32 step inputs (made once, at the first attention) from here."""

    def __init__(self, target: tvm.target.Target, accuracy_level: int = 0) -> None:
        super().__init__()
        self.target = target
        # accuracy_level 4: grouped quantized matmuls in int8 where the CPU has an int8 dot product
        self.int8_dot = int8_dot_product(target) if accuracy_level else None
        self._step_inputs: tuple[relax.Expr, relax.Expr, relax.Expr] | None = None
        self._rotary: dict[tuple[relax.Expr, relax.Expr], tuple[relax.Var, relax.Var]] = {}

    def _reshape(self, node: torch.fx.Node) -> relax.Var:
        """aten.reshape / view with symbolic sizes: TVM's own compares the shapes with Python's == (an error on
        symbolic sizes) and cannot infer a -1 beside a dynamic size, so the -1 is solved here first."""
        x, *dims = self.retrieve_args(node)
        dims = list(dims[0]) if len(dims) == 1 and isinstance(dims[0], torch.Size | tuple | list) else dims
        shape = self.shape_of(x)
        if shape is not None:
            dims = inferred_dims(list(shape), dims)
            if same_shape(list(shape), dims):
                return x
        return self._emit_torch_reshape(x, dims)

    def _empty(self, node: torch.fx.Node) -> relax.Var:
        """aten.empty (new_empty) of a symbolic shape as zeros: TVM's own passes the FX nodes of the sizes."""
        dtype = self._convert_data_type(node.kwargs.get("dtype", torch.get_default_dtype()), self.env)
        return self.block_builder.emit(relax.op.zeros(self.retrieve_args(node)[0], dtype))

    def create_input_vars(self, exported_program: torch.export.ExportedProgram):
        params, users, ranges = super().create_input_vars(exported_program)
        self.users = users
        return params, users, ranges

    @property
    def position_ids(self) -> relax.Var:
        """position_ids [1, tokens]: each packed token's position in its sequence."""
        return self.users[POSITION_IDS]

    def rotary(self, cos_table: relax.Expr, sin_table: relax.Expr) -> tuple[relax.Var, relax.Var]:
        """cos and sin [tokens, 1, head_dim] at position_ids from the tables [positions, head_dim / 2], made once per
        pair of tables (every layer shares them), not once per layer."""
        if (cos_table, sin_table) not in self._rotary:
            bb = self.block_builder
            positions = bb.emit(relax.op.reshape(self.position_ids, [self.position_ids.ty.shape[1]]))
            rows = (bb.emit(relax.op.take(t, positions, axis=0, mode="clip")) for t in (cos_table, sin_table))
            cos, sin = (bb.emit(relax.op.expand_dims(relax.op.concat([t, t], 1), 1)) for t in rows)
            self._rotary[cos_table, sin_table] = (cos, sin)
        return self._rotary[cos_table, sin_table]

    def kernel_inputs(self) -> tuple[relax.Expr, relax.Expr, relax.Expr]:
        """block_tables [S, M], past_lens [S] and query_start [S + 1] as the kernels take them (int32)."""
        if self._step_inputs is None:
            bb = self.block_builder
            tables = bb.emit(relax.op.astype(self.users[BLOCK_TABLES], "int32"))
            past = bb.emit(relax.op.astype(self.users[PAST_LENS], "int32"))
            ends = bb.emit(relax.op.cumsum(self.users[INPUT_LENS], axis=0, dtype="int32"))
            zero = relax.const(np.zeros(1, "int32"))
            starts = bb.emit(relax.op.concat([zero, ends], axis=0))
            self._step_inputs = (tables, past, starts)
        return self._step_inputs


def inferred_dims(shape: list[tirx.PrimExpr], dims: list) -> list:
    """`dims` with its -1 (if any) replaced by the size it stands for: the elements of `shape` over the other
    dims' product, simplified (n * 4 * 24 // (n * 24) is 4)."""
    if -1 not in dims:
        return dims
    analyzer = tvm.sym.Analyzer()
    total, known = 1, 1
    for size in shape:
        total = total * size
    for size in dims:
        known = known * size if not (isinstance(size, int) and size == -1) else known
    at = dims.index(-1)
    return [*dims[:at], analyzer.simplify(total // known), *dims[at + 1 :]]


def same_shape(shape: list[tirx.PrimExpr], dims: list) -> bool:
    """Whether a reshape to `dims` keeps `shape` as it is, symbolic sizes compared by the arithmetic analyzer."""
    if len(shape) != len(dims):
        return False
    analyzer = tvm.sym.Analyzer()
    return all(analyzer.can_prove_equal(a, b) for a, b in zip(shape, dims, strict=True))


def logits_output(program: Program) -> TensorSpec:
    """The step's output: the program's logits in float32 (widened on the device: a host converting float16
    logits spends longer than the GPU's step)."""
    return replace(program.outputs[program.output_names.index(LOGITS)], dtype="float32")


def step_program(program: Program) -> Program:
    """A copy of the program that returns only the logits, in float32, and holds every weight as a Parameter (so
    from_exported_program keeps them all as function parameters instead of baking them in as constants)."""
    graph = torch.fx.Graph()
    out = graph.graph_copy(program.graph_module.graph, {})
    index = program.output_names.index(LOGITS)
    logits = out[index]
    if program.outputs[index].dtype != "float32":
        logits = graph.call_function(torch.ops.aten._to_copy.default, (logits,), {"dtype": torch.float32})
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
    return replace(program, graph_module=gm, outputs=[logits_output(program)], fresh_meta=False)


def check_lowerable(exported: torch.export.ExportedProgram, converters: dict) -> None:
    """Fail before importing when a node has neither a converter of ours nor one of TVM's, naming it."""
    known = set(ExportedProgramImporter().convert_map) | set(converters)
    for node in exported.graph.nodes:
        if node.op == "call_function" and node.target.__name__ not in known:
            raise TvmLoweringError(f"the TVM backend cannot lower node {node.name} (op {node.target})")


def _prepare(exported: torch.export.ExportedProgram) -> None:
    """Rewrite what TVM's importer cannot take: negative slice dims (its dynamic-shape slice wants positive ones),
    and unsorted top-k (DeepSeek's router; torch leaves the order open, so sorted is one valid answer)."""
    for node in exported.graph.find_nodes(op="call_function", target=torch.ops.aten.slice.Tensor):
        if len(node.args) > 1 and node.args[1] < 0:
            node.args = (node.args[0], node.args[1] + node.meta["val"].dim(), *node.args[2:])
    for node in exported.graph.find_nodes(op="call_function", target=torch.ops.aten.topk.default):
        if len(node.args) > 4:
            node.args = (*node.args[:4], True)
        node.kwargs = {key: value for key, value in node.kwargs.items() if key != "sorted"}


def _copy_blocks(builder: relax.BlockBuilder, step: relax.Function, target: tvm.target.Target):
    """copy_blocks(every layer's k and v pool, src [count], dst [count]) -> the pools, copied in place."""
    types = {v.name: v.ty for v in step.params}
    num_blocks, count = tirx.Var("num_blocks", "int64"), tirx.Var("count", "int64")
    pools = [  # every KV pool, layer by layer (a hybrid model's recurrent layers have none)
        relax.Var(name, relax.TensorType([num_blocks, *list(types[name].shape)[1:]], types[name].dtype))
        for name in types
        if cache_layer(name) is not None
    ]
    src, dst = (relax.Var(name, relax.TensorType([count], "int32")) for name in COPY_INDICES)
    with builder.function(COPY_BLOCKS, [*pools, src, dst]):
        with builder.dataflow():
            copied = [emit_copy_blocks(builder, pool, src, dst, target) for pool in pools]
            out = builder.emit_output(relax.Tuple(copied))
        builder.emit_func_output(out)


def to_relax(program: Program, target: tvm.target.Target, accuracy_level: int = 0) -> RelaxModel:
    """The Relax module of a PAGED `program` for `target`: `step` for any number of packed tokens of any
    number of sequences, and `copy_blocks`; `accuracy_level` 4: grouped quantized matmuls in int8
    where the CPU has an int8 dot product (qlinear_int8.rounds_activations; 0: float32)."""
    if program.kv_layout is not KVLayout.PAGED:
        raise TvmLoweringError(
            "the TVM backend lowers PAGED programs (the paged_attention pass, e.g. "
            "with_kv_layout(pipeline, KVLayout.PAGED, block_size))"
        )
    converters = convert_map()
    exported = step_program(program).export().run_decompositions()
    _prepare(exported)
    check_lowerable(exported, converters)
    importer = StepImporter(target, accuracy_level)
    module = importer.from_exported_program(exported, True, True, False, converters)
    step = module["main"]
    names = [p.name for p in step.params[int(step.attrs["num_input"]) :]]
    params = {name: tensor.numpy() for name, tensor in zip(names, step.attrs["params"], strict=True)}
    builder = relax.BlockBuilder(tvm.IRModule({gv: f for gv, f in module.functions.items() if gv.name_hint != "main"}))
    # no tir_var_upper_bound: torch.export's bounds (65536 tokens, 4096 sequences) would make the VM plan every
    # buffer for that size; without them buffers are sized per call and pooled
    step = step.without_attr("params").without_attr("tir_var_upper_bound")
    builder.add_func(step.with_attr("global_symbol", STEP), STEP)
    _copy_blocks(builder, step, target)
    return RelaxModel(builder.get(), params, 4 if importer.int8_dot else 0)
