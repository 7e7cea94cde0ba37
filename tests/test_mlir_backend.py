"""The mlir backend: tiny models after the default pipeline (fp32, q8, int4) exported through torch-mlir reach
the torch, linalg, stablehlo and tosa dialects; each module parses again in torch-mlir's MLIR context with no
torch.operator (nor, below torch, any torch op) left, its weights function arguments rather than constants, the
token dimension dynamic except in tosa (a fixed decode step); artifacts hold the module, the weights as
safetensors, the tokenizer and the manifest; an op without a decomposition or an unreachable dialect is refused,
named, with nothing written."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import safetensors.torch
import torch

pytest.importorskip("torch_mlir")

from llmlower.api import (
    compile_artifact,  # noqa: E402
    load_engine,  # noqa: E402
)
from llmlower.backends.mlir.artifact import MODULE, WEIGHTS, build  # noqa: E402
from llmlower.backends.mlir.export import MlirLoweringError, fixed_dims, lower, op_names, torch_module  # noqa: E402  # noqa: E402
from llmlower.backends.mlir.program_executor import program_executor  # noqa: E402
from llmlower.backends.torch.program_executor import TorchExecutor  # noqa: E402
from llmlower.cli import main  # noqa: E402
from llmlower.errors import LlmlowerError  # noqa: E402
from llmlower.passes import build_pipeline, run_pipeline, with_kv_layout  # noqa: E402
from llmlower.runtime import Engine, SamplingParams, StepBatch  # noqa: E402
from llmlower.runtime.artifact import ArtifactError  # noqa: E402
from llmlower.runtime.linalg_jit import jit_opt_level, mlir_context  # noqa: E402
from llmlower.step_io import KVLayout  # noqa: E402

CASES = [
    ("llama", "none"),
    ("llama", "q8"),
    ("llama", "q4g32"),
    ("llama", "q4g64-zp4"),  # packed zero points; weight names with a dash
    ("qwen2", "none"),
    ("qwen2", "q8"),
    ("gemma", "none"),
    ("gemma", "q8"),
    ("gpt2", "none"),
    ("gpt2", "q8"),
]
DIALECTS = ("torch", "linalg", "stablehlo", "tosa")
MAX_CONTEXT = 32


@pytest.fixture(scope="module")
def programs(captures):
    """(arch, quant) -> the program after the default pipeline, built once."""
    cache = {}

    def program(arch: str, quant: str):
        if (arch, quant) not in cache:
            cache[arch, quant] = run_pipeline(captures(arch), build_pipeline(quant=quant))
        return cache[arch, quant]

    return program


@pytest.fixture(scope="module")
def modules(programs):
    """(arch, quant, static) -> the torch-dialect module, dynamic or with tosa's fixed decode step, built once."""
    cache = {}

    def module(arch: str, quant: str, static: bool = False):
        if (arch, quant, static) not in cache:
            program = programs(arch, quant)
            cache[arch, quant, static] = torch_module(program, fixed_dims(program, "tosa" if static else "torch", None))
        return cache[arch, quant, static]

    return module


def _inlined(text: str, weights: dict[str, torch.Tensor]) -> list[str]:
    """The weights whose values appear in a module's assembly (as resources, or their first 16 elements' bytes in
    a hex constant); weights of one repeated value (norm weights at init) could print as splats, and are skipped."""
    if "dense_resource<" in text:
        return ["dense_resource"]
    found = []
    for name, weight in weights.items():
        head = weight.flatten()[:16]
        if head.numel() == 16 and len(set(head.tolist())) > 1 and head.numpy().tobytes().hex().upper() in text:
            found.append(name)
    return found


@pytest.mark.parametrize("dialect", DIALECTS)
@pytest.mark.parametrize(("arch", "quant"), CASES)
def test_each_dialect_exports_and_parses_again(modules, programs, arch, quant, dialect):
    program = programs(arch, quant)
    module = lower(modules(arch, quant, static=dialect == "tosa"), dialect)
    from torch_mlir import ir

    parsed = ir.Module.parse(module.text, mlir_context())  # a fresh context: the text is all there is
    names = set(op_names(str(parsed)))
    assert "torch.operator" not in names
    if dialect != "torch":
        assert not [name for name in names if name.startswith("torch.")], sorted(names)
    assert not [name for name in names if name.startswith("llmlower")]
    step = next(op for op in parsed.body.operations if op.operation.name == "func.func")
    arguments = step.regions[0].blocks[0].arguments
    assert len(arguments) == len(program.inputs) + len(module.weights)  # the weights are arguments
    assert not _inlined(module.text, module.weights)  # ... and not constants
    types = [str(argument.type) for argument in arguments]
    if dialect == "tosa":  # a decode step: batch 1, tokens 1, the model's context
        assert not [t for t in types if "?" in t] and module.inputs[0].shape == (1, 1), types
    else:  # batch and tokens dynamic
        assert types[0] in ("!torch.vtensor<[?,?],si64>", "tensor<?x?xi64>") and module.inputs[0].shape == (
            "batch",
            "tokens",
        )


@pytest.mark.parametrize(("arch", "quant"), [("llama", "q8"), ("gpt2", "none"), ("mixtral", "q4g32-zp4")])
def test_the_decomposed_program_computes_what_the_program_does(programs, arch, quant):
    """The graph torch-mlir imports (weights as inputs, the op set decomposed by its references) run eagerly on a
    batch with past tokens: same logits and caches as the program."""
    from llmlower.backends.mlir.lift import lift_weights
    from llmlower.ir.decompositions import decomposition_table
    from llmlower.ir.program import example_inputs

    program = programs(arch, quant)
    lifted, weights = lift_weights(program)
    decomposed = lifted.export().run_decompositions(decomposition_table())
    assert not [n for n in decomposed.graph.nodes if "llmlower" in str(n.target)]
    inputs = example_inputs(program, batch=3, tokens=4, context=16, past_max=9, seed=1)
    expected = program(**inputs)
    with torch.no_grad():
        got = decomposed.module()(*inputs.values(), *weights.values())
    for name, value in zip(program.output_names, got, strict=True):
        torch.testing.assert_close(value, expected[name], atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize(
    ("arch", "quant"),
    [("llama", "q8"), ("gpt2", "none"), ("qwen3_moe", "q4mix"), ("qwen3_5", "none"), ("jamba", "none")],
)
def test_the_linalg_module_computes_the_step(modules, programs, arch, quant):
    """The dynamic linalg module compiled by torch-mlir's reference-backend passes and run by MLIR's execution
    engine with its runtime checks (an out-of-bounds access aborts): the program's logits, caches and a hybrid's
    recurrent states (its scans are loops over the step's tokens) for steps of several shapes (views that merge
    batch and tokens are where torch-mlir's linalg lowering once went wrong)."""
    from llmlower.ir.program import example_inputs
    from llmlower.runtime.linalg_jit import LinalgFunction

    program = programs(arch, quant)
    module = lower(modules(arch, quant), "linalg")
    step = LinalgFunction(module.text, verify=True)
    weights = [w.detach().numpy() for w in module.weights.values()]
    for batch, tokens, context, past in [(3, 4, 16, 9), (1, 1, 20, 12), (2, 7, 9, 0)]:
        inputs = example_inputs(program, batch=batch, tokens=tokens, context=context, past_max=past, seed=1)
        expected = program(**inputs)
        got = step(*[t.numpy() for t in inputs.values()], *weights)
        for name, value in zip(program.output_names, got, strict=True):
            np.testing.assert_allclose(value, expected[name].numpy(), atol=2e-5, rtol=1e-5, err_msg=name)


def test_an_artifact_holds_the_module_weights_tokenizer_and_manifest(tiny_llama, compiled):
    out = compiled(tiny_llama, "mlir")
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["backend"] == "mlir" and manifest["mlir"]["dialect"] == "linalg"
    assert "linalg" in manifest["mlir"]["op_dialects"] and manifest["mlir"]["static_dims"] == {}
    assert manifest["kv_layout"]["kind"] == "slots"
    step = manifest["entry_points"]["step"]
    assert step["file"] == MODULE and step["function"] == "step"
    assert [t["name"] for t in step["inputs"]][:4] == ["input_ids", "position_ids", "past_lens", "input_lens"]
    assert step["inputs"][0]["shape"] == ["batch", "tokens"]
    weights = safetensors.torch.load_file(str(out / WEIGHTS))
    listed = manifest["weights"]["tensors"]  # the arguments after the inputs, in this order
    assert sorted(t["name"] for t in listed) == sorted(weights)
    assert all(list(weights[t["name"]].shape) == t["shape"] for t in listed)
    assert "model.model.embed_tokens.weight" in weights
    assert {MODULE, WEIGHTS, "tokenizer.json", "tokenizer_config.json"} <= set(manifest["files"])
    assert "@step(" in (out / MODULE).read_text()


def test_a_linalg_artifact_generates_what_the_reference_does(tiny_llama, compiled, without_torch):
    """Engine.load runs the artifact through the linalg executor: greedy text of three prompts at once (one
    long enough for two prompt chunks) equals the torch reference's, every block comes back, and a process that
    cannot import torch runs it too (the runtime needs torch-mlir's MLIR libraries only)."""
    out = compiled(tiny_llama, "mlir")
    prompts = ["def add(a, b):", "The capital of France is", "x " * 20]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    engine = Engine.load(out, max_num_seqs=3, max_context=64, max_num_batched_tokens=32)
    reference = load_engine(tiny_llama, max_num_seqs=3, max_context=64)
    got, expected = engine.generate(prompts, params, chat=False), reference.generate(prompts, params, chat=False)
    assert [r.token_ids for r in got] == [r.token_ids for r in expected]
    assert engine.stats().kv_blocks_used == 0
    done = without_torch(
        f"""
        from llmlower.runtime import Engine, SamplingParams
        engine = Engine.load({str(out)!r}, max_context=64)
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        print(engine.generate([{prompts[0]!r}], params, chat=False)[0].token_ids)
        """
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(expected[0].token_ids)


def _decode_difference(program) -> float:
    """Largest difference between the linalg executor's logits (and caches) and the torch reference's over a
    prefill of three sequences in slots 0, 2 and 3 (a gap at 1) and 4 greedy decode steps, then a block copy."""
    ours = program_executor(program, MAX_CONTEXT)
    reference = TorchExecutor(program, MAX_CONTEXT, ours.num_blocks, ours.block_size)
    per_slot = ours.blocks_per_slot
    tables = [[slot * per_slot + b for b in range(per_slot)] for slot in (0, 2, 3)]
    rng = np.random.default_rng(0)
    tokens = [rng.integers(5, program.spec.vocab_size, n).tolist() for n in (5, 9, 3)]
    past = [0, 0, 0]
    worst = 0.0
    for _ in range(5):
        batch = StepBatch(tokens, past, tables)
        expected = reference.step(batch)
        worst = max(worst, float(np.abs(ours.step(batch) - expected).max()))
        past = [p + len(t) for p, t in zip(past, tokens, strict=True)]
        tokens = [[int(row.argmax())] for row in expected]
    for executor in (ours, reference):
        executor.copy_blocks([(tables[1][0], tables[0][1])])
    for name, cache in ours.caches.items():
        worst = max(worst, float(np.abs(cache - reference.caches[name].numpy()).max()))
    return worst


@pytest.mark.parametrize("quant", ["none", "q8"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma", "gpt2"])
def test_the_linalg_executor_matches_the_torch_reference(programs, arch, quant):
    assert _decode_difference(programs(arch, quant)) <= 1e-4


def test_modules_for_other_compilers_are_refused_by_the_runtime(tiny_llama, tmp_path):
    """tosa (a fixed decode step) is written for other MLIR compilers: loading it names the dialect and the fix."""
    out = compile_artifact(tiny_llama, tmp_path / "tosa", backend="mlir", dialect="tosa")
    with pytest.raises(ArtifactError, match=r"a 'tosa' MLIR module is for other MLIR compilers.*--dialect linalg"):
        Engine.load(out)


def test_compile_tosa_fixes_a_decode_step(tiny_llama, tmp_path, capsys):
    out = tmp_path / "tosa"
    assert main(["compile", str(tiny_llama), "-o", str(out), "--backend", "mlir", "--dialect", "tosa"]) == 0
    assert "model.mlir: function @step" in capsys.readouterr().out
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["mlir"]["static_dims"] == {"batch": 1, "tokens": 1, "context": 128, "logits": 1}
    assert manifest["entry_points"]["step"]["inputs"][4]["shape"] == [1, 2, 128, 16]  # k_cache_0
    assert manifest["mlir"]["op_dialects"] == ["builtin", "func", "tosa"]


def test_an_unreachable_dialect_is_named_and_nothing_written(programs, tmp_path):
    out = tmp_path / "tosa"
    with pytest.raises(MlirLoweringError, match=r"cannot reach tosa: .*aten\.size\.int.*--static-dims"):
        build(programs("llama", "none"), out, dialect="tosa", static_dims={"batch": 1})
    assert list(tmp_path.iterdir()) == []  # no artifact, no staging directory
    with pytest.raises(LlmlowerError, match="--dialect 'spirv': the mlir backend emits torch, linalg"):
        build(programs("llama", "none"), out, dialect="spirv")
    assert list(tmp_path.iterdir()) == []


def test_an_op_without_a_decomposition_is_named_and_nothing_written(captures, tmp_path):
    paged = run_pipeline(captures("llama"), with_kv_layout(build_pipeline(), KVLayout.PAGED, 16))
    with pytest.raises(MlirLoweringError, match=r"node paged_qkv_attention\w* \(op llmlower\.paged_qkv_attention"):
        build(paged, tmp_path / "paged")
    assert list(tmp_path.iterdir()) == []


@torch.library.custom_op("mlirtest::halve", mutates_args=())
def _halve(x: torch.Tensor) -> torch.Tensor:
    return x / 2


@_halve.register_fake
def _halve_fake(x):
    return torch.empty_like(x)


def test_an_op_outside_aten_and_the_set_is_named(programs, tmp_path):
    program = copy.deepcopy(programs("llama", "none"))
    graph = program.graph_module.graph
    output = next(node for node in graph.nodes if node.op == "output")
    logits = output.args[0][0]
    with graph.inserting_before(output):
        halved = graph.call_function(torch.ops.mlirtest.halve.default, (logits,))
    output.replace_input_with(logits, halved)
    program.graph_module.recompile()
    with pytest.raises(MlirLoweringError, match=r"node \w+ \(op mlirtest\.halve\.default\): neither an aten op"):
        build(program, tmp_path / "foreign")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("dim", [1, -1, 0])
def test_scatter_by_select_is_torch_scatter(dim):
    """The linalg-friendly scatter (DeepSeek's group mask) puts what torch.scatter puts, scalar or tensor src."""
    from llmlower.backends.mlir.scatter import scatter_by_select

    generator = torch.Generator().manual_seed(3)
    x = torch.randn(5, 6, generator=generator)
    index = torch.rand(5, 6, generator=generator).argsort(dim=dim).narrow(dim, 0, 2)  # distinct along dim
    src = torch.randn(index.shape, generator=generator)
    assert torch.equal(scatter_by_select(x, dim, index, 1.0), torch.scatter(x, dim, index, 1.0))
    assert torch.equal(scatter_by_select(x, dim, index, src), torch.scatter(x, dim, index, src))


def test_the_jit_optimization_level_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("LLMLOWER_MLIR_OPT_LEVEL", "3")
    assert jit_opt_level() == 3
    monkeypatch.setenv("LLMLOWER_MLIR_OPT_LEVEL", "fast")
    with pytest.raises(LlmlowerError, match=r"LLMLOWER_MLIR_OPT_LEVEL='fast': expected 0, 1, 2 or 3"):
        jit_opt_level()
    monkeypatch.delenv("LLMLOWER_MLIR_OPT_LEVEL")
    assert jit_opt_level() == 2


def test_a_view_that_splits_and_merges_becomes_unflatten_then_flatten():
    """[batch, tokens, 96] -> [batch * tokens * 4, 24] (OLMo's hybrid) merges two dynamic dimensions, which
    torch-mlir's view lowering guesses wrong: it becomes an unflatten of the last dimension and a flatten of the
    first three, the same tensor."""
    from llmlower.backends.mlir.views import flatten_views

    class Heads(torch.nn.Module):
        def forward(self, x):
            return x.view(-1, 24) * 2

    batch, tokens = torch.export.Dim("batch", max=64), torch.export.Dim("tokens", max=64)
    exported = torch.export.export(Heads(), (torch.randn(2, 3, 96),), dynamic_shapes=({0: batch, 1: tokens},))
    exported = exported.run_decompositions({})
    assert flatten_views(exported.graph) == 1
    targets = [n.target for n in exported.graph.nodes if n.op == "call_function"]
    assert torch.ops.aten.unflatten.int in targets and torch.ops.aten.flatten.using_ints in targets
    exported.graph_module.recompile()
    x = torch.randn(5, 7, 96)
    torch.testing.assert_close(exported.module()(x), x.view(-1, 24) * 2)
