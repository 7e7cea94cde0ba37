"""The roofline study: per-op FLOPs and bytes of a Program's steps, the machine's ceilings, measured step
times, and a report (markdown, JSON, plots) of what each pass pipeline moved."""

from .ceilings import Ceilings, machine_ceilings
from .cost import NodeCost, StepCost, decode_read_bytes, step_cost
from .shapes import Step, decode_step, prefill_step

__all__ = [
    "Ceilings",
    "NodeCost",
    "Step",
    "StepCost",
    "decode_read_bytes",
    "decode_step",
    "machine_ceilings",
    "prefill_step",
    "step_cost",
]
