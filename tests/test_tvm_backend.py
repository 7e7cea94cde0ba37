"""TVM lowering run on the Relax VM (llvm, this CPU) against the torch reference: a batched prefill, a forked
prefix and 8 decode steps through TVM's paged KV cache; cuda builds carry device code for the asked arch."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from llmlower.api import compile_artifact
from llmlower.backends.torch import TorchExecutor
from llmlower.backends.tvm import TvmLoweringError, to_relax, tvm_target
from llmlower.backends.tvm.executor import cpu_executor
from llmlower.cli import main
from llmlower.frontend import capture, load
from llmlower.passes import build_pipeline, run_pipeline
from llmlower.runtime import StepBatch
from llmlower.runtime.executors.tvm import ragged_rows

PROMPT_LENS = [5, 9, 3]


def _max_difference(program) -> float:
    """Largest logit difference between TVM and torch over a batched prefill of 3 prompts, slot 3 forked
    from slot 1's first 6 tokens, then 8 decode steps of all 4 sequences (the fork diverging from its parent)."""
    ours, reference = cpu_executor(program, max_batch=4, max_context=32), TorchExecutor(program, 4, 32)
    gen = torch.Generator().manual_seed(0)
    vocab = program.spec.vocab_size
    prompts = [torch.randint(5, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    batch = StepBatch([0, 1, 2], prompts, [0] * 3)
    worst = float(np.abs(ours.step(batch) - reference.step(batch)).max())
    for executor in (ours, reference):
        executor.fork(1, 3, 6)
    past = [*PROMPT_LENS, 6]
    for _ in range(8):
        tokens = [[int(t)] for t in torch.randint(5, vocab, (4,), generator=gen)]
        batch = StepBatch([0, 1, 2, 3], tokens, past)
        worst = max(worst, float(np.abs(ours.step(batch) - reference.step(batch)).max()))
        past = [p + 1 for p in past]
    return worst


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma", "gpt2"])
def test_fp32_tvm_matches_the_torch_reference(arch, tiny_checkpoints):
    program = run_pipeline(capture(load(tiny_checkpoints[arch])), build_pipeline())
    assert _max_difference(program) <= 1e-4


@pytest.mark.parametrize("quant", ["q8", "q4g32", "q4g32-zp4", "q4g128-sym"])
def test_quantized_lowering_is_exact(quant, tiny_checkpoints):
    """Dequantize-in-matmul computes in float32: the reference's product, int4 zero points of every kind."""
    program = run_pipeline(capture(load(tiny_checkpoints["llama"])), build_pipeline(quant=quant))
    assert _max_difference(program) <= 1e-4


def test_a_quantized_embedding_lowers(tiny_checkpoints):
    pipeline = build_pipeline(quant="q8", quantize_embedding=True)
    program = run_pipeline(capture(load(tiny_checkpoints["gpt2"])), pipeline)
    assert _max_difference(program) <= 1e-4


def test_every_position_and_a_continued_prompt(tiny_checkpoints):
    """Without last_token_logits the prefill returns every position; a sequence continued by several tokens
    after a cut-back (popn) and a restarted slot give the reference's logits."""
    program = run_pipeline(capture(load(tiny_checkpoints["llama"])), build_pipeline(all_logits=True))
    ours, reference = cpu_executor(program, max_batch=4, max_context=32), TorchExecutor(program, 4, 32)
    tokens = list(range(5, 17))
    assert np.abs(ours.prompt_logits(tokens) - reference.prompt_logits(tokens)).max() <= 1e-4
    steps = [StepBatch([0], [tokens[8:]], [8]), StepBatch([0], [[7, 8]], [4]), StepBatch([0, 1], [[9], [3, 4]], [6, 0])]
    for batch in steps:
        assert np.abs(ours.step(batch) - reference.step(batch)).max() <= 1e-4


def test_ragged_rows_of_a_padded_step():
    real, back = ragged_rows(np.array([2, 3, 1]))
    assert real.tolist() == [0, 1, 3, 4, 5, 6]  # row b, token t of a [3, 3] step sits at 3 b + t
    assert back.tolist() == [0, 1, 1, 2, 3, 4, 5, 5, 5]  # padding reads its sequence's last real token


def test_sliding_window_is_refused_by_name(tiny_checkpoints):
    program = run_pipeline(capture(load(tiny_checkpoints["mistral"])), build_pipeline())
    with pytest.raises(TvmLoweringError, match="sliding_window 6"):
        to_relax(program, tvm_target("cpu"))


@torch.library.custom_op("llmlower_test::mystery", mutates_args=())
def _mystery(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@_mystery.register_fake
def _mystery_fake(x):
    return torch.empty_like(x)


def test_an_op_without_lowering_is_named_at_compile_time(tiny_checkpoints):
    program = run_pipeline(capture(load(tiny_checkpoints["llama"])), build_pipeline())
    graph = program.graph_module.graph
    output = next(n for n in graph.nodes if n.op == "output")
    logits = output.args[0][0]
    with graph.inserting_before(output):
        doubled = graph.call_function(torch.ops.llmlower_test.mystery.default, (logits,))
    output.args = ((doubled, *output.args[0][1:]),)
    program.graph_module.recompile()
    with pytest.raises(TvmLoweringError, match=r"cannot lower node mystery\w* \(op llmlower_test.mystery"):
        to_relax(program, tvm_target("cpu"))


@pytest.fixture(scope="module")
def artifact(tiny_llama, tmp_path_factory):
    out = tmp_path_factory.mktemp("artifacts") / "tiny-llama-tvm"
    assert main(["compile", str(tiny_llama), "-o", str(out), "--backend", "tvm"]) == 0
    return out


def test_the_artifact_runs_as_the_checkpoint_without_torch(artifact, tiny_llama, without_torch, capsys):
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert (manifest["backend"], manifest["target"], manifest["kv_layout"]["kind"]) == ("tvm", "cpu", "tvm_paged")
    assert {"model.so", "weights.safetensors"} <= set(manifest["files"])
    args = ["--prompt", "Hello there", "--max-tokens", "8", "--json"]
    assert main(["generate", str(tiny_llama), *args]) == 0
    expected = json.loads(capsys.readouterr().out)["token_ids"]
    done = without_torch(
        f"""
        from llmlower.runtime import Engine, SamplingParams
        engine = Engine.load({str(artifact)!r})
        print(engine.generate(["Hello there"], SamplingParams(temperature=0, max_tokens=8))[0].token_ids)
        """
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(expected)


def test_unknown_target_and_misplaced_options_are_refused(tiny_llama, tmp_path, capsys):
    out = tmp_path / "never"
    cases = [
        (["--backend", "tvm", "--target", "tpu"], "--target 'tpu'"),
        (["--backend", "tvm", "--cuda-arch", "sm_90"], "--cuda-arch applies to --target cuda"),
        (["--backend", "tvm", "--target", "cuda", "--cuda-arch", "90"], "--cuda-arch '90'"),
        (["--backend", "onnx", "--cuda-arch", "sm_90"], "options of --backend tvm"),
    ]
    for flags, message in cases:
        assert main(["compile", str(tiny_llama), "-o", str(out), *flags]) == 1
        assert message in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="building for cuda needs nvcc (the CUDA toolkit)")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_a_cuda_artifact_carries_gpu_code_for_the_asked_arch(arch, tiny_llama, tmp_path, elf_arches):
    out = compile_artifact(tiny_llama, tmp_path / arch, backend="tvm", target="cuda", cuda_arch=arch)
    manifest = json.loads((out / "manifest.json").read_text())
    assert (manifest["dtype"], manifest["tvm"]["cuda_arch"]) == ("float16", arch)
    device_code = manifest["tvm"]["device_code"]
    assert elf_arches((out / device_code["file"]).read_bytes()) == {int(arch[3:])}
