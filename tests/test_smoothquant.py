"""The smoothquant pass: per-input-channel scales before each group of per-channel int8 linears keep the float
program, flatten activations with outlier channels so their per-row int8 rounding loses less, and come with every
per-channel int8 pipeline; its perplexity on SmolLM2 is in docs/quantization.md."""

from __future__ import annotations

import copy

import pytest

from llmlower.api import compile_program
from llmlower.errors import PassError
from llmlower.ir.norms import ADD_RMS_NORM, RMS_NORM
from llmlower.ir.program import fetch_attr
from llmlower.passes import build_pipeline, run_pipeline
from llmlower.testing import calibrated


def _float_part(quant: str) -> list:
    """The default pipeline for `quant` up to smoothquant, without quantize_weights: a float program."""
    return [p for p in build_pipeline(quant=quant) if not (isinstance(p, tuple) and p[0] == "quantize_weights")]


@pytest.mark.parametrize(("arch", "quant", "groups"), [("llama", "q4mix-a8", 2), ("gpt2", "q8c", 2)])
def test_smoothquant_keeps_the_float_program_and_takes_each_per_channel_group(arch, quant, groups, tiny_checkpoints):
    """q4mix-a8 smooths q/k/v and down (gate/up are int4: not its groups); GPT-2 in q8c its two linears after a
    LayerNorm (its fc -> proj has a GELU between). verify=True checks the float program to smoothquant's 1e-4."""
    _, program = compile_program(tiny_checkpoints[arch], _float_part(quant), verify=True)
    record = program.history[-1]
    assert record.name == "smoothquant"
    assert record.stats["groups_scaled"] == groups * program.spec.num_layers
    assert 0 < record.stats["output_error_ratio"] <= 1


def test_outlier_channels_round_with_less_error_once_smoothed(captures):
    """A norm weight with a few channels 100x the rest (what real models' q/k/v and down inputs carry) leaves a
    per-row int8 activation a handful of steps for the other channels; the scales take back half the error of
    q/k/v's and down's outputs together (down's input, after the SwiGLU, has no such channels here)."""
    program = run_pipeline(captures("llama"), build_pipeline())
    norms = {RMS_NORM.overload: 1, ADD_RMS_NORM.overload: 2}
    for node in program.graph_module.graph.nodes:
        if node.target in norms:
            weight = fetch_attr(program.graph_module, node.args[norms[node.target]].target)
            weight.data[:3] *= 100
    smoothed = run_pipeline(copy.deepcopy(program), calibrated(_float_part("q8c")[-1:]))
    assert smoothed.history[-1].stats["output_error_ratio"] < 0.6


def test_every_per_channel_int8_pipeline_smooths_and_only_those(captures):
    names = {quant: [p if isinstance(p, str) else p[0] for p in build_pipeline(quant=quant)] for quant in
             ("q4mix-a8", "q8c", "q4mix", "q8", "q4g32-sym")}  # fmt: skip
    for quant, passes in names.items():
        assert (passes[-2:] == ["smoothquant", "quantize_weights"]) == (quant in ("q4mix-a8", "q8c")), quant
    with pytest.raises(PassError, match="smoothquant: quant needs .* per-channel int8"):
        run_pipeline(captures("llama"), calibrated([("smoothquant", {"quant": {"bits": 8, "group": 32}})]))
    with pytest.raises(PassError, match="smoothquant: calibration"):
        run_pipeline(captures("llama"), [("smoothquant", {"quant": {"bits": 8, "group": 0}, "calibration": [1]})])
