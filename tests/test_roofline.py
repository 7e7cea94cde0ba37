"""The roofline study: KV bytes against worked examples, the cost model's FLOPs against
the 2 x parameters x tokens rule, ceilings (int8 by ONNX Runtime's MatMulNBits), report.json against the plots,
steps above their roofs flagged, bad input, and SmolLM2's prefill / decode placement on this machine's roofline."""

from __future__ import annotations

import copy
import json
import os

import matplotlib.image
import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import numpy_helper

from llmlower.cli import main
from llmlower.errors import LlmlowerError
from llmlower.frontend import capture, load
from llmlower.ir.quant import dequantize
from llmlower.passes import DEFAULT_PIPELINE, build_pipeline, run_pipeline
from llmlower.roofline import Ceilings, decode_read_bytes, decode_step, machine_ceilings, prefill_step, step_cost
from llmlower.roofline import ceilings as ceilings_module
from llmlower.roofline.plot import plot_kinds, plot_roofline, roof_performance
from llmlower.roofline.report import write_report
from llmlower.roofline.study import (
    PIPELINE_WORDS,
    StudyOptions,
    op_seconds,
    parse_batches,
    parse_pipelines,
    roofs_for,
    run_study,
)
from llmlower.spec import ModelSpec

BASELINE = list(PIPELINE_WORDS["baseline"])


def kv_spec(layers: int, kv_heads: int, head_dim: int, dtype: str = "float16") -> ModelSpec:
    """A spec with the fields the KV formula reads (the rest are placeholders)."""
    return ModelSpec("LlamaForCausalLM", "llama", layers, kv_heads * 8, kv_heads, head_dim, 4096, 14336, 32000,
                     8192, dtype)  # fmt: skip


def test_kv_bytes_match_worked_examples():
    """Llama-3-70B class: ~320 KB per token; Mistral-7B style: 0.5 GB for 4,096 tokens; SmolLM2: 23,040 B."""
    assert kv_spec(80, 8, 128).kv_bytes_per_token() == 2 * 80 * 8 * 128 * 2 == 320 * 1024
    assert kv_spec(32, 8, 128).kv_cache_bytes(4096) == 536_870_912 == 2**29  # 0.5 GiB
    assert kv_spec(30, 3, 64).kv_bytes_per_token() == 2 * 30 * 3 * 64 * 2 == 23_040


@pytest.fixture(scope="module")
def tiny_programs(tiny_llama):
    loaded = load(tiny_llama)
    captured = capture(loaded)
    programs = {
        "baseline": run_pipeline(copy.deepcopy(captured), BASELINE),
        "fusion+q4g32": run_pipeline(copy.deepcopy(captured), build_pipeline(quant="q4g32")),
    }
    return loaded, programs


def linear_parameters(module: torch.nn.Module) -> int:
    """Weights of every linear layer, LM head included (counted even when tied to the embedding)."""
    return sum(m.weight.numel() for m in module.modules() if isinstance(m, torch.nn.Linear))


def test_prefill_matmul_flops_are_two_x_linear_parameters_x_tokens(tiny_programs):
    loaded, programs = tiny_programs
    tokens = 24
    kinds = step_cost(programs["baseline"], prefill_step(tokens)).by_kind()
    matmul = kinds["matmul"].flops + kinds["lm_head"].flops
    assert matmul == pytest.approx(2 * linear_parameters(loaded.module) * tokens, rel=0.02)
    spec = loaded.spec
    assert kinds["attention"].flops == 4 * spec.num_layers * spec.num_heads * tokens * tokens * spec.head_dim


def test_kv_traffic_counts_kv_heads_only(tiny_programs):
    loaded, programs = tiny_programs
    spec = loaded.spec
    assert spec.num_kv_heads < spec.num_heads
    for program in programs.values():
        total = step_cost(program, decode_step(batch=3, context=40)).total
        assert total.kv_read_bytes == spec.kv_cache_bytes(40, batch=3)
        assert total.kv_write_bytes == spec.kv_cache_bytes(1, batch=3)


def test_quantized_weights_count_packed_bytes_and_scales(tiny_programs):
    """Decode reads every linear weight once: fp32 bytes in the baseline, the packed int4/int8 tensors with
    their scales and zero points under q4g32, plus (both) one embedding row."""
    loaded, programs = tiny_programs
    step = decode_step(batch=1, context=8)
    spec = loaded.spec
    row, norms, inv_freq = (
        4 * spec.hidden_size,
        4 * spec.hidden_size * (2 * spec.num_layers + 1),
        4 * spec.head_dim // 2,
    )
    baseline = step_cost(programs["baseline"], step).total.weight_bytes
    assert baseline == 4 * linear_parameters(loaded.module) + row + norms + inv_freq  # rotary's computed per step
    quant = programs["fusion+q4g32"].history[-1].stats
    q4 = step_cost(programs["fusion+q4g32"], step).total.weight_bytes
    assert q4 == quant["quantized_weight_bytes_after"] + row + norms


def test_a_decoded_token_reads_the_weights_and_the_kv_cache(tiny_programs):
    loaded, programs = tiny_programs
    for program in programs.values():
        weights = step_cost(program, decode_step(batch=1, context=40)).total.weight_bytes
        assert decode_read_bytes(program, 40) == weights + loaded.spec.kv_cache_bytes(40)
    assert decode_read_bytes(programs["fusion+q4g32"], 40) < decode_read_bytes(programs["baseline"], 40) / 3


@pytest.fixture(scope="module")
def measured_cache(tmp_path_factory):
    """A cache directory holding this machine's ceilings, measured once for the module."""
    cache = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LLMLOWER_CACHE", str(cache))
        machine_ceilings("cpu")
    return cache


@pytest.fixture()
def cpu_ceilings(measured_cache, monkeypatch):
    monkeypatch.setenv("LLMLOWER_CACHE", str(measured_cache))
    return machine_ceilings("cpu")


def test_ceilings_are_measured_cached_and_datasheets_selectable(cpu_ceilings, measured_cache):
    assert cpu_ceilings.measured and cpu_ceilings.flops["fp32"] > 1e9 and cpu_ceilings.bandwidth > 1e8
    assert cpu_ceilings.flops["int8"] > 1e9 and "MatMulNBits" in cpu_ceilings.description
    assert (measured_cache / "roofline" / "ceilings-cpu.json").is_file()
    assert machine_ceilings("cpu") == cpu_ceilings  # from the cache: a new measurement would differ
    h100 = machine_ceilings("H100")
    assert (h100.source, h100.bandwidth, h100.flops["fp16"]) == ("datasheet", 3.35e12, 989.5e12)
    assert 200 < h100.ridge("float16") < 400  # the seed: "a few hundred FLOPs per byte"
    with pytest.raises(LlmlowerError, match="--machine 'tpu'"):
        machine_ceilings("tpu")


def test_the_int8_ceiling_is_onnxruntime_matmul_nbits():
    """The int8 probe runs the kernel of the q4/q8 ONNX artifacts: MatMulNBits at accuracy_level 4 with the
    backend's attributes over the quantize pass's packing, so it computes x @ W^T (up to int8 rounding of x)."""
    model = onnx.load_from_string(ceilings_module.matmul_nbits_model(8, 96, 48, bits=4))
    [node] = model.graph.node
    attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    assert (node.op_type, node.domain) == ("MatMulNBits", "com.microsoft")
    assert attributes == {"K": 96, "N": 48, "bits": 4, "block_size": 32, "accuracy_level": 4}
    weights = {t.name: torch.tensor(numpy_helper.to_array(t)) for t in model.graph.initializer}
    w = dequantize(weights["qweight"], weights["scales"].reshape(48, 3), None, bits=4, in_features=96)
    x = np.random.default_rng(1).standard_normal((8, 96), dtype=np.float32)
    [y] = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    expected = x @ w.numpy().T
    assert np.abs(y - expected).max() <= 0.02 * np.abs(expected).max()
    assert ceilings_module.int8_matmul_rate(64, 256, 256, trials=2, runs=1) > 1e8


def test_ceilings_cached_by_the_old_method_are_measured_again(tmp_path, monkeypatch):
    """A cache file from before int8 came from MatMulNBits (torch._int_mm; its fingerprint names no method)
    is not reused; the new measurement is, until --remeasure."""
    monkeypatch.setenv("LLMLOWER_CACHE", str(tmp_path))
    old = Ceilings("cpu", "int8 by torch._int_mm", "measured", {"fp32": 1.8e11, "int8": 7.6e11}, 3.6e10)
    fingerprint = (
        f"{ceilings_module._cpu_name()} / {os.cpu_count()} cores / {torch.get_num_threads()} threads / "
        f"torch {torch.__version__}"
    )
    path = tmp_path / "roofline" / "ceilings-cpu.json"
    path.parent.mkdir()
    path.write_text(json.dumps({"fingerprint": fingerprint, "ceilings": old.to_dict()}))
    measurements = iter(["first", "second"])
    monkeypatch.setattr(
        ceilings_module, "measure_cpu", lambda: Ceilings("cpu", next(measurements), "measured", {"fp32": 1e11}, 2e10)
    )
    assert machine_ceilings("cpu").description == "first"
    assert machine_ceilings("cpu").description == "first"  # from the cache now
    assert machine_ceilings("cpu", remeasure=True).description == "second"


def test_onnx_qlinear_is_predicted_at_the_int8_roof(tiny_programs):
    """ONNX Runtime runs qlinear as MatMulNBits computing in int8 (accuracy_level 4 on the CPU): its FLOPs go
    at the int8 roof, the rest at the fp32 one. torch, TVM, accuracy_level 0 and CUDA dequantize."""
    ceilings = Ceilings("cpu", "test", "measured", {"fp32": 1e9, "int8": 4e9}, 1e9)
    roofs = roofs_for(ceilings, "float32", "onnx", accuracy_level=4)
    assert roofs.ops == {"qlinear": 4e9}
    for backend, level in (("torch", 4), ("tvm", 4), ("onnx", 0)):
        assert roofs_for(ceilings, "float32", backend, level).ops == {}
    assert roofs_for(machine_ceilings("h100"), "float16", "onnx", 4).ops == {}
    costs = step_cost(tiny_programs[1]["fusion+q4g32"], prefill_step(16))
    qlinear = sum(node.cost.flops for node in costs.nodes if node.op == "qlinear")
    assert 0 < qlinear < costs.total.flops
    compute, memory = roofs.step_seconds(costs)
    assert compute == pytest.approx(qlinear / 4e9 + (costs.total.flops - qlinear) / 1e9)
    assert memory == costs.total.bytes / 1e9


def test_a_step_measured_above_its_roof_is_flagged_and_drawn_on_its_roof(tiny_llama, tmp_path):
    """Ceilings far below this machine's (as when cached during a busy moment) put every measured step above
    its roof: report.json and report.md name the steps and say to re-measure, and the plot draws each point on
    its roof (not above it), with its % of roofline written beside it."""
    busy = Ceilings("cpu", "a busy moment", "measured", {"fp32": 1e6, "int8": 1e6}, 1e6)
    options = StudyOptions(prefill=8, batches=(2,), context=12, backend="torch", repeats=1)
    write_report(run_study(str(tiny_llama), "fusion", options, busy), tmp_path)
    saved = json.loads((tmp_path / "report.json").read_text())
    phases = saved["pipelines"][0]["phases"]
    assert all(ph["above_roof"] and ph["roofline_pct"] > 100 for ph in phases)
    assert saved["above_roof"]["steps"] == ["fusion: prefill N=8", "fusion: decode B=2 C=12"]
    assert "--remeasure" in saved["above_roof"]["note"]
    text = (tmp_path / "report.md").read_text()
    assert text.count("⚠ above roof") == 2 and saved["above_roof"]["note"] in text

    points = plot_roofline(saved, tmp_path / "again.png")
    for point, ph in zip(points, phases, strict=True):
        assert point["flops_per_s"] == pytest.approx(roof_performance(ph))
        assert point["flops_per_s"] < ph["flops"] / ph["measured_s"]
        assert point["above_roof_note"].startswith(f"{ph['roofline_pct']:.0f}% of roof")


def test_report_json_equals_what_the_plots_show(tiny_llama, cpu_ceilings, tmp_path):
    options = StudyOptions(prefill=12, batches=(1, 4), context=20, backend="torch", repeats=1)
    report = run_study(str(tiny_llama), "baseline;fusion+q8", options, cpu_ceilings)
    write_report(report, tmp_path)
    saved = json.loads((tmp_path / "report.json").read_text())
    phases = [(p["name"], ph) for p in saved["pipelines"] for ph in p["phases"]]
    assert len(phases) == 6 and all(ph["measured_s"] > 0 for _, ph in phases)

    points = plot_roofline(saved, tmp_path / "again.png")
    assert [(p["pipeline"], p["phase"]) for p in points] == [(name, ph["label"]) for name, ph in phases]
    assert saved["above_roof"] is None  # the torch backend's tiny steps are far below the roof
    for point, (_, ph) in zip(points, phases, strict=True):
        assert point["intensity"] == pytest.approx(ph["flops"] / ph["bytes"])
        assert point["flops_per_s"] == pytest.approx(ph["flops"] / ph["measured_s"])
        assert ph["roofline_pct"] == pytest.approx(100 * ph["predicted_s"] / ph["measured_s"])
        assert not ph["above_roof"] and point["above_roof_note"] is None
    peak, bandwidth = saved["machine"]["peak"], saved["machine"]["bandwidth"]
    bars = plot_kinds(saved, tmp_path / "again_kinds.png")
    for name, ph in phases:
        assert ph["predicted_s"] == pytest.approx(max(ph["flops"] / peak, ph["bytes"] / bandwidth))
        drawn = bars[ph["label"]][name]
        assert drawn == pytest.approx({k: v["predicted_s"] for k, v in ph["by_kind"].items()})
        assert sum(drawn.values()) == pytest.approx(ph["predicted_ops_s"]) and ph["predicted_ops_s"] >= ph[
            "predicted_s"
        ] * (1 - 1e-12)
        top = ph["top_ops"][0]
        assert top["predicted_s"] == max(op["predicted_s"] for op in ph["top_ops"])

    for png in ("roofline.png", "time_by_kind.png"):
        path = tmp_path / png
        assert path.stat().st_size > 20_000
        pixels = matplotlib.image.imread(path)[..., :3]
        assert len(set(map(tuple, pixels.reshape(-1, 3)[::7].round(2).tolist()))) > 20  # not blank
    assert "| baseline | prefill N=12 |" in (tmp_path / "report.md").read_text()


def test_op_seconds_is_the_slower_of_compute_and_memory():
    from llmlower.ir import Cost

    assert op_seconds(Cost(flops=100, bytes=10), peak=10, bandwidth=100) == 10
    assert op_seconds(Cost(flops=1, bytes=1000), peak=10, bandwidth=100) == 10


@pytest.mark.parametrize(
    ("text", "parameter"),
    [
        ("fused", "--pipelines"),
        ("fusion+q3", "--pipelines"),
        ("fusion;fusion", "given twice"),
        ("baseline+none", "--pipelines"),
        (" ; ", "--pipelines"),
    ],
)
def test_bad_pipeline_words_name_the_parameter(text, parameter):
    with pytest.raises(LlmlowerError, match=parameter):
        parse_pipelines(text)


def test_pipeline_words():
    (base, base_passes), (quant, quant_passes) = parse_pipelines("baseline; fusion+q4g32")
    assert (base, base_passes) == ("baseline", ["canonicalize", "state_cache", "kv_cache"])
    assert quant == "fusion+q4g32" and quant_passes == build_pipeline(quant="q4g32")
    assert parse_pipelines("fusion")[0][1] == list(DEFAULT_PIPELINE)
    assert parse_batches("1,16") == (1, 16)
    for bad in ("1,x", "0", "", "1,-2"):
        with pytest.raises(LlmlowerError, match="--batch"):
            parse_batches(bad)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--batch", "1,a"], "--batch"),
        (["--pipelines", "fusion+q5"], "--pipelines"),
        (["--prefill", "8", "--context", "100000"], "--context 100000"),
        (["--prefill", "0"], "--prefill"),
        (["--machine", "tpu"], "--machine"),
        (["--machine", "h100"], "--no-measure"),
    ],
)
def test_cli_bad_input_names_the_parameter(tiny_llama, tmp_path, capsys, flags, message, cpu_ceilings):
    code = main(["roofline", str(tiny_llama), "-o", str(tmp_path / "out"), *flags])
    err = capsys.readouterr().err
    assert code != 0 and message in err and "Traceback" not in err


def test_steps_are_timed_on_the_tvm_backend(tiny_llama, cpu_ceilings):
    options = StudyOptions(prefill=4, batches=(1,), context=8, backend="tvm", repeats=1)
    report = run_study(str(tiny_llama), "fusion+q4g32", options, cpu_ceilings)
    phases = report["pipelines"][0]["phases"]
    assert report["backend"] == "tvm" and all(phase["measured_s"] > 0 for phase in phases)


@pytest.mark.slow
def test_smollm2_on_this_machines_roofline(smollm2, cpu_ceilings):
    """Costs only (no timing): the rule of thumb on the real model; q4 decode bytes <= 0.35x the baseline's;
    prefill 512 above the ridge point, decode at batch 1 below; batch 16 multiplies decode intensity >= 10x
    at context 128. At context 512 less: 16 sequences read 16 fp32 KV caches (377 MB), while the weights
    (538 MB) are read once."""
    loaded = load(smollm2)
    assert loaded.spec.kv_bytes_per_token("float16") == 23_040
    captured = capture(loaded)
    baseline = run_pipeline(copy.deepcopy(captured), BASELINE)
    q4 = run_pipeline(captured, build_pipeline(quant="q4g32"))
    prefill = step_cost(baseline, prefill_step(512))
    kinds = prefill.by_kind()
    assert kinds["matmul"].flops + kinds["lm_head"].flops == pytest.approx(
        2 * linear_parameters(loaded.module) * 512, rel=0.02
    )
    decode = {(b, c): step_cost(baseline, decode_step(b, c)).total for b in (1, 16) for c in (128, 512)}
    assert step_cost(q4, decode_step(1, 512)).total.bytes <= 0.35 * decode[1, 512].bytes
    intensity = {key: cost.flops / cost.bytes for key, cost in decode.items()}
    assert intensity[16, 128] >= 10 * intensity[1, 128]
    assert intensity[16, 512] / intensity[1, 512] < intensity[16, 128] / intensity[1, 128]
    ridge = cpu_ceilings.ridge("float32")
    assert prefill.total.flops / prefill.total.bytes > ridge > intensity[1, 512]


def test_an_artifact_is_studied_with_its_own_pipeline(tiny_llama, cpu_ceilings, tmp_path, capsys):
    from llmlower.api import compile_artifact

    artifact = compile_artifact(tiny_llama, tmp_path / "artifact", build_pipeline(quant="q8"))
    out = tmp_path / "report"
    flags = ["--prefill", "8", "--batch", "2", "--context", "12", "--repeats", "1", "-o", str(out)]
    assert main(["roofline", str(artifact), *flags]) == 1
    assert "--checkpoint" in capsys.readouterr().err
    assert main(["roofline", str(artifact), "--pipelines", "fusion", *flags]) == 1
    assert "--pipelines" in capsys.readouterr().err
    assert main(["roofline", str(artifact), "--checkpoint", str(tiny_llama), *flags]) == 0
    report = json.loads((out / "report.json").read_text())
    [pipeline] = report["pipelines"]
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert report["backend"] == "onnx" and pipeline["name"] == "artifact"
    assert pipeline["passes"] == [step["name"] for step in manifest["pipeline"]]
    assert [ph["label"] for ph in pipeline["phases"]] == ["prefill N=8", "decode B=2 C=12"]
    assert all(ph["measured_s"] > 0 for ph in pipeline["phases"])
