"""compile --verify runs the built artifact through its own runtime executor beside the torch reference (a prefill
of three sequences, then greedy decode steps) before it is moved into place: the tiny Llama compiles on each
backend, and an artifact built by a deliberately wrong lowering (layer 0's RMSNorm scaled by 1.01: a real
artifact that computes something slightly wrong) is refused in one line naming the backend and the step, with
nothing at the output path. A cuda artifact, which cannot run here, is not run, saying why."""

from __future__ import annotations

import re
from pathlib import Path

import onnx
import pytest
from onnxscript import opset18 as op
from tvm import relax

import llmlower.backends.mlir.export as mlir_export
import llmlower.backends.onnx.lowerings as onnx_lowerings
import llmlower.backends.onnx.recurrent_lowerings as recurrent_lowerings
import llmlower.backends.tvm.lowerings as tvm_lowerings
from llmlower import progress
from llmlower.api import compile_program
from llmlower.cli import main
from llmlower.ir import RMS_NORM
from llmlower.ir.decompositions import decomposition_table
from llmlower.step_io import KVLayout
from llmlower.verify_artifact import verify_artifact

WRONG_SCALE = 1.01
BACKENDS = ["onnx", "tvm", "mlir"]
LATENT_PASSES = "canonicalize,fuse_norms,fuse_rope,fuse_projections,kv_cache,latent_cache,last_token_logits"


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("LLMLOWER_CACHE", str(tmp_path / "cache"))


def _compile(model: Path, out: Path, backend: str, *flags: str) -> int:
    return main(["compile", str(model), "-o", str(out), "--backend", backend, "--recipe", "exact", "--verify", *flags])


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_verified_artifact_is_written(backend, tiny_llama, tmp_path, capsys):
    out = tmp_path / backend
    assert _compile(tiny_llama, out, backend) == 0
    assert (out / "manifest.json").is_file()
    shown = capsys.readouterr().err
    assert f"verify the {backend} artifact against the torch reference" in shown
    assert "greedy tokens agree at 6 of 6 steps" in shown


def test_the_default_recipe_of_a_moe_model_runs_quantized_experts(tiny_checkpoints, tmp_path, capsys):
    """q4mix's experts (int4 gate/up, int8 down) run in QMoE at 8 bits on ONNX Runtime's CPU, within tolerance."""
    out = tmp_path / "qwen3_moe"
    assert _compile(tiny_checkpoints["qwen3_moe"], out, "onnx", "--quant", "q4mix") == 0
    assert "greedy tokens agree" in capsys.readouterr().err
    kernels = [node.op_type for node in onnx.load(out / "model.onnx").graph.node]
    assert kernels.count("QMoE") == 2 and "MoE" not in kernels


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_latent_cache_artifact_is_verified(backend, tiny_checkpoints, tmp_path, capsys):
    """DeepSeek's MLA caching its latent and rotary key (latent_cache, pools of their own widths) verifies on each
    backend."""
    out = tmp_path / backend
    assert _compile(tiny_checkpoints["deepseek_v3"], out, backend, "--passes", LATENT_PASSES) == 0
    assert "greedy tokens agree at 6 of 6 steps" in capsys.readouterr().err


def _break_onnx(monkeypatch: pytest.MonkeyPatch) -> None:
    """ONNX: the RMSNorm lowering's output scaled by WRONG_SCALE."""
    right = onnx_lowerings.rms_norm

    def wrong(x, weight, eps: float):
        return op.Mul(right(x, weight, eps), op.CastLike(op.Constant(value_float=WRONG_SCALE), x))

    monkeypatch.setattr(onnx_lowerings, "rms_norm", wrong)


def _break_tvm(monkeypatch: pytest.MonkeyPatch) -> None:
    """TVM: the RMSNorm converter's Relax expression scaled by WRONG_SCALE."""
    right = tvm_lowerings.CONVERTERS["rms_norm"]

    def wrong(node, importer):
        normed = right(node, importer)
        scale = relax.const(WRONG_SCALE, str(node.meta["val"].dtype).removeprefix("torch."))
        return importer.block_builder.emit(relax.op.multiply(normed, scale))

    monkeypatch.setitem(tvm_lowerings.CONVERTERS, "rms_norm", wrong)


def _break_mlir(monkeypatch: pytest.MonkeyPatch) -> None:
    """MLIR: RMSNorm's decomposition (the module's only way to compute it) scaled by WRONG_SCALE."""
    right = RMS_NORM.reference

    def wrong(x, weight, eps: float):
        return right(x, weight, eps) * WRONG_SCALE

    monkeypatch.setattr(mlir_export, "decomposition_table", lambda: {**decomposition_table(), RMS_NORM.overload: wrong})


BREAK = {"onnx": _break_onnx, "tvm": _break_tvm, "mlir": _break_mlir}


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_wrong_artifact_is_refused_in_one_line_and_nothing_written(
    backend, tiny_llama, tmp_path, monkeypatch, capsys
):
    BREAK[backend](monkeypatch)
    (tmp_path / "artifacts").mkdir()
    out = tmp_path / "artifacts" / backend
    assert _compile(tiny_llama, out, backend) == 1
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, err
    step = r"\(prefill\): logits off by .* > tolerance 0\.0001"
    pattern = rf"error: the {backend} artifact differs from the torch reference {step}"
    assert re.match(pattern, errors[0]), errors[0]
    assert "Traceback" not in err
    assert not out.exists()
    assert list(out.parent.iterdir()) == []  # no staging directory left either


def test_generate_refuses_a_wrong_artifact_before_caching_it(tiny_llama, tmp_path, monkeypatch, capsys):
    """generate, chat and serve compile through the cache, which runs the artifact against the torch reference
    first: a wrong one is refused in one line and never cached (so never run silently)."""
    _break_onnx(monkeypatch)
    args = ["generate", str(tiny_llama), "--prompt", "Hi", "--max-tokens", "2", "--backend", "onnx", "--quant", "none"]
    args.append("--raw")
    assert main(args) == 1
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "differs from the torch reference (prefill)" in errors[0], err
    artifacts = tmp_path / "cache" / "artifacts"
    assert not any(path.name == "manifest.json" for path in artifacts.rglob("*")), list(artifacts.rglob("*"))


def test_a_wrong_recurrent_state_is_refused(tiny_checkpoints, tmp_path, monkeypatch, capsys):
    """A hybrid model's states are compared as its logits are: a conv state written 1% off is refused at the
    prefill, before any logits read it."""
    right = recurrent_lowerings.causal_conv1d

    def wrong(*args):
        out, state = right(*args)
        return out, op.Mul(state, op.CastLike(op.Constant(value_float=WRONG_SCALE), state))

    monkeypatch.setattr(recurrent_lowerings, "causal_conv1d", wrong)
    out = tmp_path / "lfm2"
    assert _compile(tiny_checkpoints["lfm2"], out, "onnx") == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert re.match(r"error: the onnx artifact .* \(prefill\): recurrent state conv_state_\d off by", errors[0])
    assert not out.exists()


class Recorder:
    """A progress reporter keeping each finished stage's description and detail."""

    def __init__(self) -> None:
        self.finished: list[tuple[str, str]] = []

    def start(self, description: str) -> None:
        pass

    def finish(self, description: str, seconds: float, detail: str) -> None:
        self.finished.append((description, detail))


def test_a_cuda_artifact_is_not_run_and_says_why(tiny_llama, compiled):
    """A cuda artifact (float16 PagedAttention for ONNX Runtime's CUDA EP) is not run on this CPU: one stage line
    says the check was skipped and why. (The float16 program is built without --verify: the per-pass check's
    float32 threshold refuses float16 passes.)"""
    out = compiled(tiny_llama, target="cuda")
    _, program = compile_program(tiny_llama, dtype="float16", kv_layout=KVLayout.PAGED, block_size=16)
    recorder = Recorder()
    progress.use_reporter(recorder)
    try:
        verify_artifact(program, out)
    finally:
        progress.use_reporter(None)
    [(description, detail)] = recorder.finished
    assert description == "verify the onnx artifact against the torch reference"
    assert detail == "skipped: a cuda artifact runs on a GPU; verification runs artifacts on this machine's CPU"
