"""The gptq pass: rounding each linear against the inputs it sees on calibration tokens keeps quantize_weights'
stored formats (so every backend runs it as it is), cuts the quantized outputs' error, and reaches artifacts
through the compile's calibration."""

from __future__ import annotations

import json

import pytest
import torch

from llmlower.api import compile_artifact
from llmlower.cli import main
from llmlower.errors import PassError
from llmlower.ir.quant import QuantScheme, dequantize, quantize
from llmlower.passes import build_pipeline, parse_quant, run_pipeline
from llmlower.passes.gptq import gptq_quantize
from llmlower.passes.quantize_weights import QuantPlan
from llmlower.runtime import Engine, SamplingParams
from llmlower.testing import calibrated

SCHEMES = ["q4g32-sym", "q4g32", "q4g32-zp4", "q4g128-sym", "q8", "q8c"]


def _scheme(name: str) -> QuantScheme:
    return QuantPlan.of(**parse_quant(name)).scheme


def _inputs_and_weight(rows: int = 96, inputs: int = 256, tokens: int = 400) -> tuple[torch.Tensor, torch.Tensor]:
    """Calibration inputs whose channels differ in size and correlate (as a norm's outputs do), and a weight."""
    generator = torch.Generator().manual_seed(0)
    mixing = torch.randn(inputs, inputs, generator=generator) / inputs**0.5 + torch.eye(inputs)
    x = torch.randn(tokens, inputs, generator=generator) @ mixing * torch.rand(inputs, generator=generator) * 3
    return x, torch.randn(rows, inputs, generator=generator) * 0.05


def _output_error(x: torch.Tensor, weight: torch.Tensor, packed, scheme: QuantScheme) -> float:
    rounded = dequantize(packed.qweight, packed.scales, packed.zeros, scheme.bits, packed.in_features)
    return float((x @ (rounded - weight).T).pow(2).sum())


@pytest.mark.parametrize("name", SCHEMES)
def test_gptq_rounding_is_stored_as_nearest_rounding_is_with_less_output_error(name):
    scheme = _scheme(name)
    x, weight = _inputs_and_weight()
    chosen, nearest = gptq_quantize(weight, scheme, x.T @ x), quantize(weight, scheme)
    for got, want in zip(
        (chosen.qweight, chosen.scales, chosen.zeros), (nearest.qweight, nearest.scales, nearest.zeros), strict=True
    ):
        assert (got is None) == (want is None)
        assert got is None or (got.shape, got.dtype) == (want.shape, want.dtype)
    assert chosen.in_features == nearest.in_features
    assert _output_error(x, weight, chosen, scheme) < 0.7 * _output_error(x, weight, nearest, scheme)


@pytest.mark.parametrize("name", ["q4g32-sym", "q4g32-zp4", "q8", "q8c"])
def test_uncorrelated_unit_inputs_leave_nothing_to_compensate(name):
    """With H = I no column's error can be taken back by another: GPTQ's rounding is nearest rounding."""
    scheme = _scheme(name)
    _, weight = _inputs_and_weight()
    chosen, nearest = gptq_quantize(weight, scheme, torch.eye(weight.shape[1])), quantize(weight, scheme)
    assert torch.equal(chosen.qweight, nearest.qweight) and torch.equal(chosen.scales, nearest.scales)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])  # gpt2: Conv1D's transposed weights
def test_the_pass_quantizes_what_quantize_weights_does_with_less_error(arch, captures):
    """verify=True runs the quantized program against the float one (quantize_weights' tolerance)."""
    pipeline = build_pipeline(quant="q4g32-sym", gptq=True)
    assert pipeline[-1][0] == "gptq"
    program = run_pipeline(captures(arch), calibrated(pipeline), verify=True)
    stats = program.history[-1].stats
    nearest = run_pipeline(captures(arch), build_pipeline(quant="q4g32-sym")).history[-1].stats
    counted = ("linears_quantized", "linears_kept", "quantized_weight_bytes_after", "lm_head")
    assert {key: stats[key] for key in counted} == {key: nearest[key] for key in counted}
    assert 0 < stats["output_error_ratio"] < 1
    assert stats["calibration_tokens"] == 96


def test_gptq_needs_a_quant_and_calibration(captures):
    with pytest.raises(PassError, match="need --quant"):
        build_pipeline(gptq=True)
    with pytest.raises(PassError, match="gptq: calibration"):
        run_pipeline(captures("llama"), [("gptq", {"bits": 4, "calibration": [1]})])
    with pytest.raises(PassError, match="gptq: bits must be 4 or 8"):
        run_pipeline(captures("llama"), [("gptq", {"bits": 3, "calibration": [1, 2, 3]})])


def test_a_gptq_artifact_matches_its_reference_and_generates(tiny_llama, tmp_path, capsys):
    """The compile fills the pass's calibration; the ONNX artifact runs the chosen rounding (verify compares it
    with the torch reference)."""
    pipeline = build_pipeline(quant="q4g32-sym", awq=True, gptq=True)
    artifact = compile_artifact(tiny_llama, tmp_path / "gptq", pipeline, verify=True)
    steps = {step["name"]: step for step in json.loads((artifact / "manifest.json").read_text())["pipeline"]}
    assert list(steps)[-2:] == ["awq", "gptq"]
    assert steps["gptq"]["stats"]["calibration_tokens"] > 100
    engine = Engine.load(artifact, max_num_seqs=1, max_context=64)
    result = engine.generate(["The quick brown fox"], SamplingParams(temperature=0, max_tokens=8))[0]
    assert len(result.token_ids) == 8
    assert main(["generate", str(artifact), "--prompt", "x", "--gptq"]) != 0
    assert "--gptq apply when compiling" in capsys.readouterr().err
