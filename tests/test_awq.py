"""The awq pass: activation-aware scales folded into the ops before each int4 linear keep the float program (on
every architecture family whose producers it can fold), shrink the quantized outputs' error on the calibration
text, and reach artifacts through the compile's calibration; the quality gain on SmolLM2 is in test_smollm2."""

from __future__ import annotations

import json

import pytest
import torch

from llmlower.api import compile_artifact, compile_program
from llmlower.cli import main
from llmlower.errors import PassError
from llmlower.ir.norms import ADD_RMS_NORM, RMS_NORM
from llmlower.ir.program import fetch_attr
from llmlower.passes import build_pipeline, run_pipeline
from llmlower.runtime import Engine, SamplingParams


def _awq_only(quant: str) -> list:
    """The default pipeline with the awq pass for `quant` but without quantize_weights: a float program."""
    pipeline = build_pipeline(quant=quant, awq=True)
    return [p for p in pipeline if not (isinstance(p, tuple) and p[0] == "quantize_weights")]


# (architecture, groups each decoder layer scales): q/k/v, gate/up and down where a norm or the SwiGLU's up
# projection feeds them (GPT-2 and BLOOM: a GELU between fc and proj, so the two after a LayerNorm; a MoE layer's
# experts are no linears, so q/k/v alone), never o_proj: its input comes from the values in the KV cache, which
# would have to hold them divided by the scales
FOLDABLE = {"llama": 3, "qwen2": 3, "qwen3": 3, "gemma2": 3, "gpt2": 2, "bloom": 2, "qwen3_moe": 1}


@pytest.mark.parametrize("arch", FOLDABLE)
def test_awq_keeps_the_float_program_and_rescales_each_foldable_group(arch, tiny_checkpoints):
    """verify=True runs each pass's program against the one before on random inputs (awq's tolerance: 1e-4)."""
    _, before = compile_program(tiny_checkpoints[arch], build_pipeline())
    _, after = compile_program(tiny_checkpoints[arch], _awq_only("q4g32-sym"), verify=True)
    record = after.history[-1]
    assert record.name == "awq"
    assert record.stats["groups_scaled"] == FOLDABLE[arch] * after.spec.num_layers
    assert 0 < record.stats["output_error_ratio"] <= 1
    changed = [
        name
        for name, value in [*before.graph_module.named_parameters(), *before.graph_module.named_buffers()]
        if not torch.equal(value, fetch_attr(after.graph_module, name))
    ]
    norms = {RMS_NORM.overload: 1, ADD_RMS_NORM.overload: 2, torch.ops.aten.layer_norm.default: 2}
    norm_weights = {n.args[norms[n.target]].target for n in after.graph_module.graph.nodes if n.target in norms}
    assert norm_weights & set(changed), changed  # a norm took 1/s


def test_awq_needs_int4_weights_and_calibration(tiny_llama):
    with pytest.raises(PassError, match="need --quant"):
        build_pipeline(awq=True)
    with pytest.raises(PassError, match="awq: quant needs"):
        compile_program(tiny_llama, _awq_only("q8"))
    _, program = compile_program(tiny_llama, build_pipeline())
    with pytest.raises(PassError, match="calibration"):
        run_pipeline(program, [("awq", {"quant": {"bits": 4}, "calibration": [1]})])


def test_an_awq_artifact_records_its_scales_and_generates(tiny_llama, tmp_path):
    """The compile fills the pass's calibration; the artifact's q4 weights are those of the rescaled program."""
    artifact = compile_artifact(tiny_llama, tmp_path / "awq", build_pipeline(quant="q4g32-sym", awq=True))
    manifest = json.loads((artifact / "manifest.json").read_text())
    steps = {step["name"]: step for step in manifest["pipeline"]}
    assert list(steps)[-2:] == ["awq", "quantize_weights"]
    assert steps["awq"]["stats"]["calibration_tokens"] > 100
    engine = Engine.load(artifact, max_num_seqs=1, max_context=64)
    result = engine.generate(["The quick brown fox"], SamplingParams(temperature=0, max_tokens=8))[0]
    assert len(result.token_ids) == 8


def test_awq_flag_is_refused_for_a_compiled_artifact(tiny_llama, tmp_path, capsys):
    artifact = compile_artifact(tiny_llama, tmp_path / "plain")
    assert main(["generate", str(artifact), "--prompt", "x", "--awq"]) != 0
    assert "--awq apply when compiling" in capsys.readouterr().err
