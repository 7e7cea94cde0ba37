"""The study: compile a model through each named pipeline, cost its steps, time them on a backend, and
gather everything into the report dict that report.py writes and plot.py draws.

Pipeline words: `baseline` = canonicalize + state_cache + kv_cache (every op unfused, the LM head over every position);
`fusion` = the default pipeline (norm, rope, projection and qkv-attention fusion, last_token_logits);
`WORD+QUANT` appends quantize_weights with a --quant name (q8, q4g32, q4g128-sym, ...), e.g. fusion+q4g32.
"""

from __future__ import annotations

import copy
import re
import statistics
from collections import defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch.fx

from ..api import with_calibration
from ..errors import LlmlowerError, PassError
from ..frontend import capture, load, resolve_model
from ..ir import Cost
from ..ir.program import Program
from ..passes import DEFAULT_PIPELINE, build_pipeline, run_pipeline
from ..passes.manager import PassSpec
from ..progress import stage
from ..runtime.artifact import read_manifest
from ..spec import ModelSpec
from .ceilings import Ceilings
from .cost import KINDS, NodeCost, StepCost, step_cost
from .measure import artifact_executor, build_executor, check_backend, time_step, timed_program
from .shapes import Step, decode_step, prefill_step

PIPELINE_WORDS: dict[str, tuple[str, ...]] = {
    "baseline": ("canonicalize", "state_cache", "kv_cache"),
    "fusion": DEFAULT_PIPELINE,
}
TOP_OPS = 5
ABOVE_ROOF_NOTE = (
    "measured above its roof: the ceilings are too low (measured during a busy moment?); re-measure them with "
    "--remeasure. If a step stays above, its bytes come from the last-level cache (a model that fits in it), a "
    "prefetched read stream outruns the copy the bandwidth ceiling measures, or the cost model over-counts its work."
)


@dataclass(frozen=True)
class StudyOptions:
    """What to study: prompt length of the prefill, decode batches at one context, timing repeats, and the
    onnx backend's MatMulNBits accuracy_level (4: int8 compute, the backend's default)."""

    prefill: int = 512
    batches: tuple[int, ...] = (1, 16)
    context: int = 512
    backend: str = "onnx"
    repeats: int = 5
    measure: bool = True
    accuracy_level: int = 4

    def steps(self) -> list[Step]:
        return [prefill_step(self.prefill), *(decode_step(b, self.context) for b in self.batches)]


def parse_pipelines(text: str) -> list[tuple[str, list[PassSpec]]]:
    """(word, passes) for each ';'-separated pipeline word of --pipelines."""
    words = [w.strip() for w in text.split(";") if w.strip()]
    if not words:
        raise LlmlowerError("--pipelines: expected ';'-separated pipeline words, e.g. 'baseline;fusion+q4g32'")
    pipelines = []
    for word in words:
        base, _, quant = word.partition("+")
        if base not in PIPELINE_WORDS:
            raise LlmlowerError(
                f"--pipelines: unknown pipeline {word!r} (expected {' or '.join(PIPELINE_WORDS)}, optionally +QUANT)"
            )
        try:
            passes = build_pipeline(list(PIPELINE_WORDS[base]), quant=quant or "none")
        except PassError as exc:
            raise LlmlowerError(f"--pipelines {word!r}: {exc}") from None
        if quant == "none":
            raise LlmlowerError(f"--pipelines {word!r}: write {base} for no quantization")
        if word in (name for name, _ in pipelines):
            raise LlmlowerError(f"--pipelines: {word!r} is given twice")
        pipelines.append((word, passes))
    return pipelines


def parse_batches(text: str) -> tuple[int, ...]:
    """Decode batch sizes from a comma-separated --batch list."""
    try:
        batches = tuple(int(b) for b in text.split(","))
    except ValueError:
        raise LlmlowerError(f"--batch: expected comma-separated positive integers, got {text!r}") from None
    if not batches or min(batches) < 1:
        raise LlmlowerError(f"--batch: expected comma-separated positive integers, got {text!r}")
    return batches


def check_options(options: StudyOptions, spec: ModelSpec) -> None:
    """Each size positive and within the model's positions; at least one repeat."""
    for name, value in (("--prefill", options.prefill), ("--context", options.context)):
        if not 1 <= value <= spec.max_positions:
            raise LlmlowerError(f"{name} {value}: expected 1 to {spec.max_positions} (the model's positions)")
    if options.repeats < 1:
        raise LlmlowerError(f"--repeats {options.repeats}: expected at least 1")


def check_measurable(options: StudyOptions, ceilings: Ceilings) -> None:
    """Step times only mean something against ceilings measured where the steps run (the backends time
    steps on the CPU)."""
    if options.measure and not ceilings.measured:
        raise LlmlowerError(f"--machine {ceilings.machine}: datasheet ceilings; add --no-measure (no such GPU here)")
    if options.measure and ceilings.machine != "cpu":
        raise LlmlowerError(f"--machine {ceilings.machine}: steps are timed on the CPU only; add --no-measure")


def op_seconds(cost: Cost, peak: float, bandwidth: float) -> float:
    """Roofline time of work `cost`: bound by compute or by memory, whichever is slower."""
    return max(cost.flops / peak, cost.bytes / bandwidth)


@dataclass(frozen=True)
class Roofs:
    """The roofs a program's steps run under: the memory bandwidth, and the compute peak of each op (`ops` for
    ops computing in another precision than the model's dtype, `peak` for the rest)."""

    peak: float
    bandwidth: float
    ops: dict[str, float] = field(default_factory=dict)

    def op_peak(self, op: str) -> float:
        return self.ops.get(op, self.peak)

    def node_seconds(self, node: NodeCost) -> float:
        """Roofline time of one node at its op's peak."""
        return op_seconds(node.cost, self.op_peak(node.op), self.bandwidth)

    def step_seconds(self, costs: StepCost) -> tuple[float, float]:
        """(compute, memory) seconds of a whole step: every node's FLOPs at its op's peak, all bytes at the
        bandwidth."""
        compute = sum(node.cost.flops / self.op_peak(node.op) for node in costs.nodes)
        return compute, costs.total.bytes / self.bandwidth


def roofs_for(ceilings: Ceilings, dtype: str, backend: str, accuracy_level: int) -> Roofs:
    """The model dtype's compute roof for every op, except qlinear where ONNX Runtime's CPU MatMulNBits runs it
    in int8 (accuracy_level 4; the int8 ceiling measures that kernel). torch, TVM and accuracy_level 0
    dequantize the weights and compute in the model's dtype."""
    int8 = backend == "onnx" and accuracy_level == 4 and ceilings.machine == "cpu" and "int8" in ceilings.flops
    return Roofs(ceilings.peak(dtype), ceilings.bandwidth, {"qlinear": ceilings.flops["int8"]} if int8 else {})


def _op_group(node: NodeCost, modules: dict[str, str]) -> str:
    """An op and the module it came from with layer numbers as '*' (one group for all layers' q_proj)."""
    module = re.sub(r"\.\d+\.", ".*.", modules.get(node.name, "")).removeprefix("model.")
    return f"{node.op} {module}".strip()


def _module_paths(program: Program) -> dict[str, str]:
    """Node name -> where it comes from: the first weight it reads (fused and quantized weights keep their
    layer's path), else the innermost module torch.export recorded for it."""
    paths = {}
    for node in program.graph_module.graph.nodes:
        weights = [a.target for a in node.args if isinstance(a, torch.fx.Node) and a.op == "get_attr"]
        stack = node.meta.get("nn_module_stack") or {}
        if weights:
            paths[node.name] = weights[0]
        elif stack:
            paths[node.name] = str(list(stack.values())[-1][0])
    return paths


def phase_entry(costs: StepCost, roofs: Roofs, modules: dict[str, str], times: list[float] | None) -> dict[str, Any]:
    """One pipeline's numbers for one step: totals, roofline prediction, measurement (flagged when faster than
    the prediction: above its roof), per-kind and top ops."""
    step, total = costs.step, costs.total
    compute_s, memory_s = roofs.step_seconds(costs)
    predicted = max(compute_s, memory_s)
    kinds: dict[str, dict[str, float]] = {k: {"flops": 0, "bytes": 0, "predicted_s": 0.0} for k in KINDS}
    groups: dict[str, dict[str, Any]] = defaultdict(lambda: {"count": 0, "flops": 0, "bytes": 0, "predicted_s": 0.0})
    for node in costs.nodes:
        seconds = roofs.node_seconds(node)
        for row in (kinds[node.kind], groups[_op_group(node, modules)]):
            row["flops"] += node.cost.flops
            row["bytes"] += node.cost.bytes
            row["predicted_s"] += seconds
        groups[_op_group(node, modules)].update(kind=node.kind)
        groups[_op_group(node, modules)]["count"] += 1
    top = sorted(groups.items(), key=lambda item: -item[1]["predicted_s"])[:TOP_OPS]
    measured = statistics.median(times) if times else None
    return {
        "phase": step.phase,
        "label": step.label,
        "batch": step.batch,
        "tokens": step.tokens,
        "context": step.context,
        "flops": total.flops,
        "bytes": total.bytes,
        "weight_bytes": total.weight_bytes,
        "activation_bytes": total.activation_bytes,
        "kv_read_bytes": total.kv_read_bytes,
        "kv_write_bytes": total.kv_write_bytes,
        "intensity": total.flops / total.bytes,
        "peak": total.flops / compute_s if compute_s else roofs.peak,
        "bound": "compute" if compute_s >= memory_s else "memory",
        "predicted_s": predicted,
        "predicted_ops_s": sum(k["predicted_s"] for k in kinds.values()),
        "measured_s": measured,
        "measured_runs_s": times,
        "roofline_pct": 100 * predicted / measured if measured else None,
        "above_roof": measured is not None and measured < predicted,
        "by_kind": kinds,
        "top_ops": [{"op": name, **row} for name, row in top],
    }


def study_program(
    name: str, program: Program, ceilings: Ceilings, options: StudyOptions, executor_for: Any
) -> dict[str, Any]:
    """Cost every step of `program`; time them on the executor `executor_for(max_batch, max_context)` makes
    when measuring."""
    steps = options.steps()
    executor = None
    if options.measure:
        executor = executor_for(max(s.batch for s in steps), max(s.context for s in steps))
    modules = _module_paths(program)
    roofs = roofs_for(ceilings, program.spec.dtype, options.backend, options.accuracy_level)
    phases, ops = [], set()
    for step in steps:
        with stage(f"{name}: {step.label}") as shown:
            costs = step_cost(program, step)
            ops.update(node.op for node in costs.nodes)
            times = time_step(executor, step, options.repeats) if executor is not None else None
            shown.detail = f"{costs.total.flops / 1e9:.2f} GFLOP, {costs.total.bytes / 1e6:.1f} MB"
            if times:
                shown.detail += f", median {statistics.median(times) * 1000:.1f} ms"
        phases.append(phase_entry(costs, roofs, modules, times))
    return {
        "name": name,
        "passes": [record.name for record in program.history],
        "op_peaks": {op: peak for op, peak in roofs.ops.items() if op in ops},  # ops not at the dtype's roof
        "phases": phases,
    }


def above_roof(pipelines: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The steps measured faster than their roofline prediction ('pipeline: phase') with what to do about it;
    None when every step is at or below its roof."""
    steps = [f"{p['name']}: {ph['label']}" for p in pipelines for ph in p["phases"] if ph["above_roof"]]
    return {"steps": steps, "note": ABOVE_ROOF_NOTE} if steps else None


def _report(model: str, spec: ModelSpec, ceilings: Ceilings, options: StudyOptions, pipelines: list) -> dict:
    dtype = spec.dtype
    return {
        "model": model,
        "architecture": spec.architecture,
        "dtype": dtype,
        "backend": options.backend,
        "kv_bytes_per_token": spec.kv_bytes_per_token(),
        "state_bytes_per_sequence": spec.state_bytes,
        "options": {"prefill": options.prefill, "batches": list(options.batches), "context": options.context},
        "repeats": options.repeats if options.measure else 0,
        "machine": {**ceilings.to_dict(), "peak": ceilings.peak(dtype), "ridge": ceilings.ridge(dtype)},
        "pipelines": pipelines,
        "above_roof": above_roof(pipelines),
    }


def run_study(
    model: str, pipelines: str, options: StudyOptions, ceilings: Ceilings, dtype: str = "float32"
) -> dict[str, Any]:
    """The report of MODEL (a checkpoint, .gguf or 'example') under each pipeline word of `pipelines`."""
    words = parse_pipelines(pipelines)  # bad words and a missing backend fail before the model loads
    if options.measure:
        check_backend(options.backend)
    check_measurable(options, ceilings)
    loaded = load(resolve_model(model), dtype=dtype)
    check_options(options, loaded.spec)
    captured = capture(loaded)
    results = []
    for word, uncalibrated in words:
        passes = with_calibration(uncalibrated, loaded)  # smoothquant (per-channel int8) is calibrated
        program = run_pipeline(copy.deepcopy(captured), passes)

        def executor_for(max_batch: int, max_context: int, passes: list = passes) -> Any:
            timed = timed_program(options.backend, captured, passes)  # in the backend's KV layout
            return build_executor(options.backend, timed, max_batch, max_context)

        results.append(study_program(word, program, ceilings, options, executor_for))
    return _report(str(model), program.spec, ceilings, options, results)  # the caches as the passes laid them out


def artifact_passes(manifest: dict[str, Any]) -> list[PassSpec]:
    """The pipeline an artifact was compiled with, as costed: without paged_attention (the per-slot program;
    the paged layout moves the same bytes, addressed by blocks)."""
    return [(p["name"], p["options"]) for p in manifest["pipeline"] if p["name"] != "paged_attention"]


def run_artifact_study(
    artifact: Path, checkpoint: str | None, options: StudyOptions, ceilings: Ceilings
) -> dict[str, Any]:
    """The report of a compiled artifact: its manifest's pipeline replayed on `checkpoint` (the model it was
    compiled from) for the costs, its own executor for the times."""
    manifest = read_manifest(artifact)
    if checkpoint is None:
        raise LlmlowerError(f"{artifact} is an artifact: --checkpoint names the model it was compiled from")
    check_measurable(options, ceilings)
    passes = artifact_passes(manifest)
    loaded = load(resolve_model(checkpoint), dtype=manifest["dtype"])
    compiled = ModelSpec.from_dict(manifest["spec"])
    if loaded.spec != replace(compiled, kv_widths=None, state_bytes=0):  # the passes' cache layout
        raise LlmlowerError(f"--checkpoint {checkpoint}: its spec differs from the one in {artifact}/manifest.json")
    check_options(options, loaded.spec)
    program = run_pipeline(capture(loaded), passes)

    def executor_for(max_batch: int, max_context: int) -> Any:
        return artifact_executor(artifact, max_batch, max_context)

    level = manifest.get("onnx", {}).get("accuracy_level", options.accuracy_level)
    options = replace(options, backend=manifest["backend"], accuracy_level=level)
    result = study_program(Path(artifact).name, program, ceilings, options, executor_for)
    return _report(str(artifact), program.spec, ceilings, options, [result])
