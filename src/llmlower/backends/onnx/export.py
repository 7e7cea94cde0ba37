"""Program -> ONNX model: torch.onnx.export (dynamo) of the re-exported graph with the op set's lowerings."""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator

import onnx
import torch

from ...errors import LlmlowerError
from ...ir import OPS, PAGED_ATTENTION, PAGED_QKV_ATTENTION, PAGED_RECURRENT, QKV_ATTENTION
from ...ir.program import Program
from ...step_io import PRESENT_PREFIX
from .lowerings import translations
from .paged_lowerings import PAGED_DTYPES
from .token_loops import expand_token_loops

MAX_IR_VERSION = 10  # what the onnxruntime builds we support load (they accept up to 13 at most)


class LoweringError(LlmlowerError):
    """A node of the program has no ONNX lowering."""


PAGED_OPS = (PAGED_ATTENTION.overload, PAGED_QKV_ATTENTION.overload)
CACHE_ARGUMENTS = {
    PAGED_ATTENTION.overload: (3, 5),
    QKV_ATTENTION.overload: (1, 3),
    PAGED_QKV_ATTENTION.overload: (1, 3),
}


def _activation_dtype(node: torch.fx.Node, program: Program) -> str:
    """The dtype of a node's first argument (its activations), the program's dtype when not recorded."""
    value = node.args[0].meta.get("val") if isinstance(node.args[0], torch.fx.Node) else None
    return str(value.dtype).removeprefix("torch.") if isinstance(value, torch.Tensor) else program.spec.dtype


def _head_sizes(node: torch.fx.Node) -> set[int]:
    """The key and value head sizes of an attention node (its caches' or pools' last dimensions)."""
    first, end = CACHE_ARGUMENTS[node.target]
    return {int(cache.meta["val"].shape[-1]) for cache in node.args[first:end] if "val" in cache.meta}


def check_lowerable(program: Program) -> None:
    """Fail before exporting when an op of the set has no ONNX lowering, a paged attention runs in a type
    ONNX Runtime's PagedAttention lacks, or keys and values have head sizes of their own where ONNX Runtime's
    op takes one (a packed qkv; PagedAttention's v_head_size is for its latent layout only), or a paged attention
    has ALiBi slopes (PagedAttention has no attention bias input) or either is chunked, naming the node."""
    ours = {opdef.overload for opdef in OPS.values()}
    lowered = translations()
    gm = program.graph_module
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in ours:
            continue
        if node.target in PAGED_RECURRENT.values():
            raise LoweringError(
                f"the ONNX backend cannot lower node {node.name} (op {node.target}): a hybrid model's recurrent "
                "state in pools of rows (the paged layout) has no ONNX Runtime kernel; the CPU target keeps it per "
                "sequence (--target cpu), TVM runs the paged layout (--backend tvm)"
            )
        if node.target not in lowered:
            raise LoweringError(f"the ONNX backend cannot lower node {node.name} (op {node.target})")
        if node.target in PAGED_OPS and (dtype := _activation_dtype(node, program)) not in PAGED_DTYPES:
            raise LoweringError(
                f"the ONNX backend cannot lower node {node.name} (op {node.target}) in {dtype}: ONNX Runtime's "
                "PagedAttention (CUDA) runs float16 here; compile for --target cuda (float16 by default)"
            )
        packed = node.target in CACHE_ARGUMENTS  # the paged and packed-qkv attentions
        given = node.normalized_arguments(gm, normalize_to_only_use_kwargs=True).kwargs if packed else {}
        paged = node.target in PAGED_OPS
        if paged and given.get("k_scale") is not None:
            raise LoweringError(
                f"the ONNX backend cannot lower node {node.name} (op {node.target}) with an int8 pool: ONNX Runtime's "
                "PagedAttention has no quantized cache (the CPU target's GroupQueryAttention has)"
            )
        if given.get("window", 0) < 0:
            raise LoweringError(
                f"the ONNX backend cannot lower node {node.name} (op {node.target}): chunked local attention has no "
                "attribute in ONNX Runtime's packed-qkv and paged attention (the unpacked padded layout takes it)"
            )
        if paged and given.get("alibi_slopes") is not None:
            raise LoweringError(
                f"the ONNX backend cannot lower node {node.name} (op {node.target}): ONNX Runtime's PagedAttention "
                "has no attention bias for ALiBi (the CPU target's GroupQueryAttention has; TVM's kernels too)"
            )
        if node.target in CACHE_ARGUMENTS and len(_head_sizes(node)) > 1:
            raise LoweringError(
                f"the ONNX backend cannot lower node {node.name} (op {node.target}): its keys and values have "
                "head sizes of their own, which ONNX Runtime's packed-qkv and paged attention take in one size only"
            )


def output_name(name: str, input_names: list[str]) -> str:
    """ONNX names each value once: an updated cache (same name as its input in the Program) becomes
    present_<name>, as ONNX Runtime's own models name present key/values."""
    return f"{PRESENT_PREFIX}{name}" if name in input_names else name


@contextlib.contextmanager
def _quiet_exporter() -> Iterator[None]:
    """Hide the exporter's noise that says nothing about this model (torchvision ops it skips, a pytree
    deprecation); real errors still raise."""
    registration = logging.getLogger("torch.onnx._internal.exporter._registration")
    level = registration.level
    registration.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=FutureWarning)
            yield
    finally:
        registration.setLevel(level)


def to_onnx(program: Program, accuracy_level: int = 4) -> onnx.ModelProto:
    """The program as an ONNX model whose inputs and outputs carry the program's names; `accuracy_level`
    is MatMulNBits' (see lowerings.qlinear_lowering)."""
    check_lowerable(program)
    exported = program.export()
    table = translations(accuracy_level)
    with _quiet_exporter():
        onnx_program = torch.onnx.export(exported, custom_translation_table=table, dynamo=True, verbose=False)
    for value, spec in zip(onnx_program.model.graph.outputs, program.outputs, strict=True):
        value.name = output_name(spec.name, program.input_names)
    model = onnx_program.model_proto
    expand_token_loops(model)
    model.ir_version = min(model.ir_version, MAX_IR_VERSION)
    return model
