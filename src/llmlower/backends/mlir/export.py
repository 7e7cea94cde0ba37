"""Program -> MLIR with torch-mlir: torch.export of the program with its weights as arguments (lift.py), the op
set decomposed to aten ops by each op's own reference (ir.decompositions), torch-mlir's FX importer, then its
pass pipelines down to the asked dialect. Errors name the node, op or dialect at fault; nothing is written here."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch._decomp import get_decompositions

from ...errors import LlmlowerError
from ...ir.decompositions import decomposition_table
from ...ir.program import Program, TensorSpec
from ...ir.registry import op_of
from ...runtime.linalg_jit import mlir_context
from .lift import lift_weights
from .scatter import SCATTER_DECOMPOSITION
from .topk import TOPK_DECOMPOSITION
from .views import FLATTEN, flatten_views

FUNCTION = "step"
# --dialect -> torch-mlir's pass pipeline from its torch backend IR (the "torch" dialect) to that dialect
DIALECTS = {
    "torch": None,
    "linalg": "torch-backend-to-linalg-on-tensors-backend-pipeline{allow-non-finites=true}",
    # aten.flatten (views.py) back to a view first: StableHLO lowers views by their sizes, exactly
    "stablehlo": "func.func(torch-decompose-complex-ops), "
    "torch-backend-to-stablehlo-backend-pipeline{allow-non-finites=true}",
    "tosa": "torch-backend-to-tosa-backend-pipeline",
}
DEFAULT_DIALECT = "linalg"
# torch-mlir's TOSA lowering legalizes no dynamic size: its modules are built for fixed sizes
STATIC_ONLY = {"tosa": "torch-mlir's TOSA lowering legalizes no dynamic size (aten.size.int)"}
STATIC_DIMS = ("batch", "tokens", "context")  # the dimensions --static-dims may fix ("logits" follows batch)
TORCH_BACKEND = (
    "func.func(torch-match-quantized-custom-ops), "
    f"torchdynamo-export-to-torch-backend-pipeline{{backend-legal-ops={FLATTEN} extra-library=}}"
)
ATEN_NAMESPACES = ("aten", "prims")  # what torch-mlir imports as torch dialect ops
# aten ops torch-mlir lowers less exactly than torch's own decompositions do: its tanh-GELU is off by up to 5e-5
# (x ~ N(0, 9)); torch's mul/add/tanh form is exact to float32 rounding (2e-7)
PRECISE_DECOMPOSITIONS = [torch.ops.aten.gelu]


class MlirLoweringError(LlmlowerError):
    """A node of the program has no way into MLIR, or the module cannot reach the asked dialect."""


@dataclass
class MlirModule:
    """A step function in one dialect: its arguments are `inputs` (the program's) then the weights, in order."""

    text: str
    dialect: str
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    weights: dict[str, torch.Tensor]
    static_dims: dict[str, int]

    @property
    def op_dialects(self) -> list[str]:
        """The dialects of the module's ops (a consumer needs each of them)."""
        return sorted({name.split(".")[0] for name in op_names(self.text)})


def require_torch_mlir() -> None:
    """torch-mlir is an optional dependency (the mlir extra): say so before compiling, not after."""
    if importlib.util.find_spec("torch_mlir") is None:
        raise MlirLoweringError("the mlir backend needs torch-mlir: pip install 'llmlower[mlir]'")


def check_dialect(dialect: str) -> None:
    if dialect not in DIALECTS:
        raise MlirLoweringError(f"--dialect {dialect!r}: the mlir backend emits {', '.join(DIALECTS)}")


def check_static_dims(given: dict[str, int] | None) -> None:
    """Each fixed dimension is one of STATIC_DIMS with a positive size."""
    for name, size in (given or {}).items():
        if name not in STATIC_DIMS:
            raise MlirLoweringError(f"--static-dims {name}={size}: the step's dimensions are {', '.join(STATIC_DIMS)}")
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise MlirLoweringError(f"--static-dims {name}={size!r}: a size must be a positive integer")


def fixed_dims(program: Program, dialect: str, given: dict[str, int] | None) -> dict[str, int]:
    """The dimensions fixed in the module: `given`, or for a dialect that has no dynamic sizes a decode step
    (batch 1, tokens 1, the model's whole context); the logits count follows a fixed batch (one per sequence)."""
    check_static_dims(given)
    names = {d for t in program.inputs for d in t.shape if isinstance(d, str)}
    if given is None:
        given = {"batch": 1, "tokens": 1, "context": program.spec.max_positions} if dialect in STATIC_ONLY else {}
    fixed = {name: size for name, size in given.items() if name in names}
    if "context" in fixed and fixed["context"] > program.spec.max_positions:
        raise MlirLoweringError(
            f"--static-dims context={fixed['context']}: the model has {program.spec.max_positions} positions"
        )
    if "batch" in fixed and "logits" in names:
        fixed["logits"] = fixed["batch"]
    return fixed


def check_lowerable(program: Program) -> None:
    """Fail before exporting when a node calls an op that cannot reach MLIR as aten ops: an op of the set
    without a decomposition, or an op outside both aten and the set; names the node and op."""
    table = decomposition_table()
    for node in program.graph_module.graph.nodes:
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload) or target in table:
            continue
        opdef = op_of(target)
        if opdef is not None:
            raise MlirLoweringError(
                f"the mlir backend cannot lower node {node.name} (op {target}): op {opdef.name!r} has no "
                "decomposition (its reference implementation in ir/ does not trace: it loops over per-sequence "
                "lengths)"
            )
        if target.namespace not in ATEN_NAMESPACES:
            raise MlirLoweringError(
                f"the mlir backend cannot lower node {node.name} (op {target}): neither an aten op nor an op of "
                "llmlower's set, so it has no decomposition"
            )


def torch_module(program: Program, fixed: dict[str, int] | None = None) -> MlirModule:
    """The program as torch-mlir's torch backend IR (the "torch" dialect), dynamic in every named dimension but
    those `fixed`; the weights are arguments, returned beside the module."""
    require_torch_mlir()
    check_lowerable(program)
    from torch_mlir.extras.fx_decomp_util import get_decomposition_table
    from torch_mlir.extras.fx_importer import FxImporter

    fixed = fixed or {}
    lifted, weights = lift_weights(program)
    try:
        table = {**get_decomposition_table(), **get_decompositions(PRECISE_DECOMPOSITIONS), **TOPK_DECOMPOSITION}
        table.update(SCATTER_DECOMPOSITION)
        table.update(decomposition_table())
        exported = lifted.export(fixed).run_decompositions(table)
        flatten_views(exported.graph)
        exported.graph_module.recompile()
        importer = FxImporter(context=mlir_context())
        importer.import_frozen_program(exported, func_name=FUNCTION)  # every tensor is an input: nothing to freeze
    except Exception as error:  # torch.export's and the importer's errors are long: the first line says what
        raise MlirLoweringError(f"importing the program into MLIR failed: {_first_line(error)}") from error
    _run(importer.module, TORCH_BACKEND, "torch")
    _check_no_operator(str(importer.module), "torch")
    inputs = [_fixed_spec(t, fixed) for t in program.inputs]
    outputs = [_fixed_spec(t, fixed) for t in program.outputs]
    return MlirModule(str(importer.module), "torch", inputs, outputs, weights, fixed)


def lower(module: MlirModule, dialect: str) -> MlirModule:
    """`module` (torch dialect) lowered to `dialect` by torch-mlir's pipeline; fails naming what did not lower."""
    from torch_mlir import ir

    check_dialect(dialect)
    if dialect == module.dialect:
        return module
    parsed = ir.Module.parse(module.text, mlir_context())
    dynamic = [d for d in STATIC_DIMS if any(d in t.shape for t in module.inputs)]
    hint = f" ({STATIC_ONLY[dialect]}: fix {', '.join(dynamic)} with --static-dims)" if dialect in STATIC_ONLY else ""
    _run(parsed, DIALECTS[dialect], dialect, hint if dynamic else "")
    text = str(parsed)
    _check_no_operator(text, dialect)
    leftover = sorted({name for name in op_names(text) if name.startswith("torch.")})
    if leftover:
        raise MlirLoweringError(f"the module cannot reach {dialect}: torch ops left after lowering: {leftover}")
    return MlirModule(text, dialect, module.inputs, module.outputs, module.weights, module.static_dims)


def to_mlir(program: Program, dialect: str = DEFAULT_DIALECT, fixed: dict[str, int] | None = None) -> MlirModule:
    """The program's step function in `dialect`, its weights apart; `fixed` sizes (see fixed_dims) or, for a
    dialect without dynamic sizes, a decode step's."""
    check_dialect(dialect)
    return lower(torch_module(program, fixed_dims(program, dialect, fixed)), dialect)


def op_names(text: str) -> Iterator[str]:
    """The name of every op in a module's assembly (parsed in a fresh context)."""
    from torch_mlir import ir

    names: list[str] = []

    def visit(op: Any) -> Any:
        names.append(op.name)
        return ir.WalkResult.ADVANCE

    ir.Module.parse(text, mlir_context()).operation.walk(visit)
    return iter(names)


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _fixed_spec(spec: TensorSpec, fixed: dict[str, int]) -> TensorSpec:
    return TensorSpec(spec.name, spec.dtype, tuple(fixed.get(d, d) if isinstance(d, str) else d for d in spec.shape))


def _check_no_operator(text: str, dialect: str) -> None:
    """An op torch-mlir does not know stays `torch.operator "name"`: refused, named."""
    if 'torch.operator "' in text:
        names = sorted({part.split('"')[0] for part in text.split('torch.operator "')[1:]})
        raise MlirLoweringError(f"the module cannot reach {dialect}: ops without a lowering: {', '.join(names)}")


def _run(module: Any, pipeline: str, dialect: str, hint: str = "") -> None:
    """Run a torch-mlir pass pipeline on `module`, its error diagnostics collected into the error it raises."""
    from torch_mlir.passmanager import PassManager

    errors: list[str] = []

    def collect(diagnostic: Any) -> bool:
        if str(diagnostic.severity).endswith("ERROR"):
            errors.append(" ".join(str(diagnostic.message).split()))  # one line: the CLI prints one
        return True

    context = module.context
    handler = context.attach_diagnostic_handler(collect)
    try:
        with context:
            context.emit_error_diagnostics = True  # to `collect` (some passes report errors without failing)
            PassManager.parse(f"builtin.module({pipeline})").run(module.operation)
    except Exception as error:
        detail = "; ".join(dict.fromkeys(errors)) or _first_line(error)
        raise MlirLoweringError(f"the module cannot reach {dialect}: {detail}{hint}") from None
    finally:
        handler.detach()
    if errors:
        raise MlirLoweringError(f"the module cannot reach {dialect}: {'; '.join(dict.fromkeys(errors))}")
