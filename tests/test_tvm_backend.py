"""TVM lowering of PAGED programs run on the Relax VM (llvm, this CPU) against the torch reference on the same
block tables: packed prompts, a prompt chunk continuing a sequence, a sequence forked from another's prefix
(shared blocks plus a copied partial block) and decode steps, blocks scattered through the pool; artifacts
run without torch; cuda builds carry device code for the asked arch."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import tvm

from llmlower.api import compile_artifact
from llmlower.backends.registry import get_backend
from llmlower.backends.torch.program_executor import TorchExecutor
from llmlower.backends.tvm.compile import compile_module, cuda_source, tvm_target
from llmlower.backends.tvm.int8_dot import int8_dot_product
from llmlower.backends.tvm.low_batch import LOW_BATCH_BUCKETS, low_batch_dispatch
from llmlower.backends.tvm.lowerings import TvmLoweringError, convert_map
from llmlower.backends.tvm.program_executor import program_executor
from llmlower.backends.tvm.relax_import import StepImporter, to_relax
from llmlower.backends.tvm.silu_mul_kernel import silu_mul_kernel
from llmlower.cli import main
from llmlower.ir import PAGED_LATENT_ATTENTION
from llmlower.passes import build_pipeline, run_pipeline, with_kv_layout
from llmlower.runtime import StepBatch
from llmlower.runtime.executor import copy_rounds
from llmlower.runtime.executors.tvm import aligned_empty, physical_cores, use_threads
from llmlower.step_io import KVLayout
from llmlower.testing import calibrated

BLOCK_SIZE, MAX_CONTEXT, NUM_BLOCKS = 4, 32, 40
FORK_AT = 18  # sequence 3 starts as sequence 1's first 18 tokens: 4 shared blocks, the partial 5th copied
# new tokens per step for sequences 0..3 (0: not in the step): three prompts; decodes with a prompt chunk taking
# sequence 1 to FORK_AT; the fork's prompt chunk with decodes; decodes of all four; one sequence's decode alone
# (a one-row step: the CPU's quantized matmuls take another path then)
STEPS = [[5, 9, 3, 0], [1, 9, 1, 0], [1, 1, 1, 3], [1, 1, 1, 1], [1, 1, 1, 1], [0, 1, 0, 0]]
TOLERANCE = 1e-4
LATENT_PASSES = (
    "canonicalize,fuse_norms,fuse_rope,fuse_projections,kv_cache,latent_cache,fuse_qkv_attention,last_token_logits"
)


def _paged(captures, arch: str, **options):
    pipeline = with_kv_layout(calibrated(build_pipeline(**options)), KVLayout.PAGED, BLOCK_SIZE)
    return run_pipeline(captures(arch), pipeline)


def _block_tables(rng: np.random.Generator) -> list[list[int]]:
    """Scattered block ids for the four sequences' final lengths; sequence 3 shares sequence 1's first 4 blocks
    and gets a fresh block for the partial 5th (the copy) and the rest."""
    totals = np.sum(STEPS, axis=0)
    totals[3] += FORK_AT
    ids = iter(rng.permutation(NUM_BLOCKS).tolist())
    tables = [[next(ids) for _ in range(-(-int(total) // BLOCK_SIZE))] for total in totals[:3]]
    shared = FORK_AT // BLOCK_SIZE
    tables.append(tables[1][:shared] + [next(ids) for _ in range(-(-int(totals[3]) // BLOCK_SIZE) - shared)])
    return tables


def _max_difference(program, accuracy_level: int = 0) -> float:
    """Largest logit difference between TVM and torch over STEPS (see the module docstring), then every pool's
    difference after chained block copies (in order: a block copied into one that is copied on)."""
    ours = program_executor(program, MAX_CONTEXT, NUM_BLOCKS, accuracy_level=accuracy_level)
    reference = TorchExecutor(program, MAX_CONTEXT, NUM_BLOCKS)
    rng = np.random.default_rng(0)
    vocab = program.spec.vocab_size
    tables = _block_tables(rng)
    past = [0, 0, 0, FORK_AT]
    worst = 0.0
    for new in STEPS:
        if new[3]:  # sequence 3 forks sequence 1: its partial block is copied before either writes into it
            for executor in (ours, reference):
                executor.copy_blocks([(tables[1][FORK_AT // BLOCK_SIZE], tables[3][FORK_AT // BLOCK_SIZE])])
        rows = [i for i, n in enumerate(new) if n]
        batch = StepBatch(
            [rng.integers(5, vocab, new[i]).tolist() for i in rows], [past[i] for i in rows], [tables[i] for i in rows]
        )
        worst = max(worst, float(np.abs(ours.step(batch) - reference.step(batch)).max()))
        past = [p + n for p, n in zip(past, new, strict=True)]
    spare = sorted(set(range(NUM_BLOCKS)) - {b for table in tables for b in table})
    chain = [(tables[0][0], spare[0]), (spare[0], spare[1]), (tables[2][1], tables[0][0])]
    for executor in (ours, reference):
        executor.copy_blocks(chain)
    for name, pool in ours.pools.items():
        worst = max(worst, float(np.abs(pool.numpy() - reference.caches[name].numpy()).max()))
    return worst


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma", "gemma2", "gpt2", "mistral"])
def test_fp32_tvm_matches_the_torch_reference(arch, captures):
    """mistral: sliding window 6, which the kernels apply over the blocks."""
    assert _max_difference(_paged(captures, arch)) <= TOLERANCE


def test_the_latent_cache_matches_the_torch_reference(captures):
    """DeepSeek's MLA caching its latent and rotary key (latent_cache): the latent kernels over pools of their own
    widths, a forked prefix and block copies included."""
    program = _paged(captures, "deepseek_v3", passes=LATENT_PASSES)
    targets = {n.target for n in program.graph_module.graph.nodes}
    assert PAGED_LATENT_ATTENTION.overload in targets
    assert _max_difference(program) <= TOLERANCE


@pytest.mark.parametrize("quant", ["q8", "q8c", "q4g32", "q4g32-zp4", "q4g128-sym", "q4mix"])
def test_quantized_lowering_is_exact(quant, captures):
    """Dequantize-in-matmul computes in float32: the reference's product, int4 zero points of every kind."""
    assert _max_difference(_paged(captures, "llama", quant=quant)) <= TOLERANCE


@pytest.mark.parametrize(
    ("arch", "quant"), [("llama", "q4g32"), ("llama", "q4mix"), ("llama", "q4g128-sym"), ("mixtral", "q4g32-zp4")]
)
def test_float16_scales_are_widened_where_they_are_read(arch, quant, captures):
    """Scales and float zero points kept in float16 beside float32 activations: the CPU kernel reads them so, the
    fallback and the experts' reductions dequantize in float32; the reference's logits."""
    program = _paged(captures, arch, quant=quant, scale_dtype="float16")
    assert _max_difference(program) <= TOLERANCE


def test_the_silu_mul_kernel_is_silu_of_the_gate_times_up():
    """Its vector exp against torch's silu, gates far past exp's float32 range included (clamped there)."""
    width = 64
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 2, 2 * width, generator=gen) * 6
    x[0, 0, :4] = torch.tensor([-200.0, -90.0, 90.0, 200.0])
    library = tvm.compile(
        tvm.IRModule({"main": silu_mul_kernel(width).with_attr("global_symbol", "main")}), target=tvm_target("cpu")
    )
    out = tvm.runtime.tensor(np.zeros((3, 2, width), "float32"))
    library["main"](tvm.runtime.tensor(x.numpy()), out)
    expected = torch.nn.functional.silu(x[..., :width]) * x[..., width:]
    np.testing.assert_allclose(out.numpy(), expected.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(int8_dot_product(tvm_target("cpu")) is None, reason="no int8 dot product on this CPU")
@pytest.mark.parametrize(
    ("arch", "quant", "scale_dtype"),
    [
        ("llama", "q4g32", None),
        ("llama", "q4mix", None),
        ("llama", "q4g32", "float16"),
        ("mixtral", "q4mix", "float16"),
    ],
)
def test_accuracy_level_4_rounds_the_activations(arch, quant, scale_dtype, captures):
    """Every step's grouped matmuls in int8 (prompts and decode rows; a MoE layer's chosen experts too): off the
    reference by the rounding of x, within the tolerance compile --verify gives rounded activations (the backend's,
    of the largest logit, at least 1); float16 scales read by the int8 kernel too."""
    program = _paged(captures, arch, quant=quant, scale_dtype=scale_dtype)
    difference = _max_difference(program, accuracy_level=4)
    assert TOLERANCE < difference <= get_backend("tvm").tolerance.rounded_activations


@pytest.mark.parametrize(("arch", "quant"), [("mixtral", "q4g32-zp4"), ("qwen3_moe", "q4mix"), ("mixtral", "q8")])
def test_quantized_experts_are_exact(arch, quant, captures):
    """qmoe_experts dequantizes the chosen experts inside its reductions: the reference's logits."""
    assert _max_difference(_paged(captures, arch, quant=quant)) <= TOLERANCE


def test_a_quantized_embedding_lowers(captures):
    assert _max_difference(_paged(captures, "gpt2", quant="q8", quantize_embedding=True)) <= TOLERANCE


def test_every_position_logits(captures):
    """Without last_token_logits the step returns every packed token's logits: prompt_logits scores them all,
    and steps still give each sequence's last token."""
    program = _paged(captures, "llama", all_logits=True)
    ours = program_executor(program, MAX_CONTEXT, NUM_BLOCKS)
    reference = TorchExecutor(program, MAX_CONTEXT, NUM_BLOCKS)
    tokens = list(range(5, 22))
    expected = reference.prompt_logits(tokens)
    assert expected.shape == (len(tokens), program.spec.vocab_size)
    assert np.abs(ours.prompt_logits(tokens) - expected).max() <= TOLERANCE
    batch = StepBatch([[7, 8, 9], [3]], [0, 0], [[9, 2], [5]])
    assert np.abs(ours.step(batch) - reference.step(batch)).max() <= TOLERANCE


@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.float16])
def test_step_inputs_are_staged_at_aligned_addresses(dtype):
    """TVM takes a CPU array without copying only at a 64-byte address: the buffers step inputs are staged in
    start at one, whatever their size and element type."""
    for size in (1, 3, 8, 1000):
        buffer = aligned_empty(size, np.dtype(dtype))
        assert buffer.ctypes.data % 64 == 0 and buffer.shape == (size,) and buffer.dtype == dtype
        buffer[...] = np.arange(size)
        assert tvm.runtime.from_dlpack(buffer).numpy().tolist() == buffer.tolist()


def test_block_copies_run_in_order():
    """Copies run in parallel rounds; a copy reading or overwriting a block an earlier one writes, or writing one
    it reads, waits for the next round."""
    assert copy_rounds([(1, 2), (3, 4), (2, 5), (6, 3), (7, 8), (9, 8), (8, 1)]) == [
        ([1, 3], [2, 4]),
        ([2, 6, 7], [5, 3, 8]),
        ([9], [8]),
        ([8], [1]),
    ]


def test_a_slots_program_is_refused(captures):
    program = run_pipeline(captures("llama"), build_pipeline())
    with pytest.raises(TvmLoweringError, match="lowers PAGED programs"):
        to_relax(program, tvm_target("cpu"))


def _tvm_function(module: torch.nn.Module, x: torch.Tensor):
    """module(x) for any number of tokens (x's first axis), imported by the TVM backend's converters and compiled by
    its CPU pipeline (DLight schedules included)."""
    tokens = torch.export.Dim("tokens", min=1, max=1024)
    exported = torch.export.export(module, (x,), dynamic_shapes=({0: tokens},)).run_decompositions()
    target = tvm_target("cpu")
    imported = StepImporter(target).from_exported_program(exported, False, True, False, convert_map())
    vm = tvm.relax.VirtualMachine(compile_module(imported, target), tvm.cpu())
    return lambda x: vm["main"](tvm.runtime.tensor(x.numpy())).numpy()


class _WrittenOutLayerNorm(torch.nn.Module):
    """Cohere's LayerNorm (no bias), written out in mean, variance and rsqrt as transformers has it."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.linspace(0.5, 1.5, 64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(-1, keepdim=True)
        variance = (x - mean).pow(2).mean(-1, keepdim=True)
        return self.weight * ((x - mean) * torch.rsqrt(variance + 1e-5))


def test_a_written_out_layer_norm_is_exact_over_many_rows():
    """The sum of squares is a row reduction the CPU's matmul schedule takes, its rows split in parallel chunks;
    x - mean is computed in the same function outside those chunks, so the epilogue reading it stays after them
    (folded into the chunks, each chunk computed every row, reading rows other threads had not normed yet:
    Cohere's logits off by 0.15; on one thread the rows a chunk read were stale but right)."""
    norm = _WrittenOutLayerNorm()
    gen = torch.Generator().manual_seed(0)
    run = _tvm_function(norm, torch.randn(5, 1, 64, generator=gen))
    use_threads(4)
    try:
        for tokens in (1, 7, 64, 200):
            x = torch.randn(tokens, 1, 64, generator=gen) * 3 + 1
            np.testing.assert_allclose(run(x), norm(x).detach().numpy(), rtol=1e-5, atol=1e-5)
    finally:
        use_threads(physical_cores())


class _NegativeSelects(torch.nn.Module):
    """Falcon's grouped k and v (x[..., -2, :] and x[..., -1, :] of [tokens, kv_heads, group + 2, head_dim]) and a
    negative index on the symbolic axis (the last token)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, :, -2] + 2 * x.select(2, -1) + 3 * x[-1, :, -1]


def test_a_negative_select_index_counts_from_the_end():
    selects = _NegativeSelects()
    gen = torch.Generator().manual_seed(0)
    run = _tvm_function(selects, torch.randn(5, 2, 4, 16, generator=gen))
    for tokens in (1, 3, 9):
        x = torch.randn(tokens, 2, 4, 16, generator=gen)
        np.testing.assert_allclose(run(x), selects(x).numpy(), rtol=1e-6, atol=1e-6)


@torch.library.custom_op("llmlower_test::mystery", mutates_args=())
def _mystery(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@_mystery.register_fake
def _mystery_fake(x):
    return torch.empty_like(x)


def test_an_op_without_lowering_is_named_at_compile_time(captures):
    program = _paged(captures, "llama")
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
    args = ["compile", str(tiny_llama), "-o", str(out), "--backend", "tvm", "--block-size", "8", "--recipe", "exact"]
    assert main(args) == 0
    return out


def test_the_artifact_runs_as_the_checkpoint_without_torch(artifact, tiny_llama, without_torch, capsys):
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert (manifest["backend"], manifest["target"]) == ("tvm", "cpu")
    layout = {"kind": "paged", "block_size": 8, "layers": 2, "kv_heads": 2, "head_dim": 16, "dtype": "float32"}
    assert manifest["kv_layout"] == {**layout, "shape": ["num_blocks", "block_size", "kv_heads", "head_dim"]}
    assert set(manifest["entry_points"]) == {"step", "copy_blocks"}
    assert {"model.so", "weights.safetensors"} <= set(manifest["files"])
    assert manifest["tvm"]["vm_exec"] == "compiled"  # the VM's calls as native code: the cpu default
    args = ["--prompt", "Hello there", "--max-tokens", "8", "--json"]
    assert main(["generate", str(tiny_llama), *args, "--backend", "torch"]) == 0
    expected = json.loads(capsys.readouterr().out)["token_ids"]
    done = without_torch(
        f"""
        from llmlower.runtime import Engine, EngineConfig, SamplingParams
        engine = Engine.load({str(artifact)!r}, EngineConfig(max_num_seqs=2, max_context=64))
        params = SamplingParams(temperature=0, max_tokens=8)
        results = engine.generate(["Hello there", "Hello there"], params)
        print([result.token_ids for result in results])
        print(engine.executor.block_size, engine.executor.num_blocks)
        """
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == [str([expected, expected]), "8 16"]


def test_a_bytecode_vm_gives_the_same_tokens_and_can_be_instrumented(artifact, tiny_llama, tmp_path):
    """--vm-exec bytecode: the VM interprets the step (slower), which lets a per-call hook time each kernel."""
    from llmlower.errors import LlmlowerError
    from llmlower.runtime import Engine, EngineConfig, SamplingParams

    with pytest.raises(LlmlowerError, match="--vm-exec 'jit': the tvm backend takes compiled or bytecode"):
        compile_artifact(tiny_llama, tmp_path / "never", backend="tvm", vm_exec="jit")
    out = compile_artifact(tiny_llama, tmp_path / "bytecode", backend="tvm", vm_exec="bytecode", block_size=8)
    assert json.loads((out / "manifest.json").read_text())["tvm"]["vm_exec"] == "bytecode"
    config, params = EngineConfig(max_num_seqs=1, max_context=64), SamplingParams(temperature=0, max_tokens=8)
    engines = [Engine.load(path, config) for path in (artifact, out)]
    called = []
    engines[1].executor.vm.set_instrument(lambda func, name, before, *rest: called.append(name) or 0)
    tokens = [engine.generate(["Hello there"], params)[0].token_ids for engine in engines]
    assert tokens[0] == tokens[1] and len(tokens[0]) == 8
    assert any(name.startswith("paged_attention") for name in called)


def _cores() -> int:
    """This process's CPUs counted as cores: distinct sets of hyper-thread siblings (Linux's topology files)."""
    siblings = {
        Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").read_text()
        for cpu in os.sched_getaffinity(0)
    }
    return len(siblings)


def test_an_engine_runs_tvm_on_one_thread_per_core_by_default(artifact, without_torch):
    # TVM's own default is half the logical CPUs (hyper-threads assumed): one thread on a 2-vCPU VM
    if not Path("/sys/devices/system/cpu/cpu0/topology/thread_siblings_list").exists():
        pytest.skip("needs Linux's CPU topology files")
    done = without_torch(
        f"""
        import tvm
        from llmlower.runtime import Engine, EngineConfig, SamplingParams
        engine = Engine.load({str(artifact)!r}, EngineConfig(max_num_seqs=1, max_context=64))
        engine.generate(["Hello there"], SamplingParams(temperature=0, max_tokens=2))
        print(tvm.get_global_func("runtime.NumThreads")())
        """
    )
    assert done.returncode == 0, done.stderr
    assert int(done.stdout.split()[0]) == _cores()


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
@pytest.mark.parametrize(("arch", "quant"), [("sm_80", "none"), ("sm_90", "q4g32")])
def test_a_cuda_artifact_carries_gpu_code_for_the_asked_arch(arch, quant, tiny_llama, compiled, elf_arches):
    """float32 and int4 weights (the dequantizing matmul kernels) alike: float16, paged, the asked arch's code."""
    out = compiled(tiny_llama, "tvm", quant, target="cuda", cuda_arch=arch)
    manifest = json.loads((out / "manifest.json").read_text())
    assert (manifest["dtype"], manifest["tvm"]["cuda_arch"]) == ("float16", arch)
    assert manifest["kv_layout"]["kind"] == "paged"
    assert manifest["entry_points"]["step"]["outputs"][0]["dtype"] == "float32"  # widened on the GPU, not the host
    assert manifest["tvm"]["vm_exec"] == "bytecode"  # the compiled VM has not run on a GPU yet
    device_code = manifest["tvm"]["device_code"]
    assert elf_arches((out / device_code["file"]).read_bytes()) == {int(arch[3:])}


def _dynamic_rows_module() -> tvm.IRModule:
    """A float16 matmul over a dynamic number of rows [n, 256] x [512, 256]^T, and an add over the same rows."""
    rows, depth, columns = tvm.tirx.Var("n", "int64"), tvm.tirx.IntImm("int64", 256), tvm.tirx.IntImm("int64", 512)
    x = tvm.te.placeholder((rows, depth), "float16", name="x")
    w = tvm.te.placeholder((columns, depth), "float16", name="w")
    k = tvm.te.reduce_axis((0, depth), name="k")
    product = tvm.te.compute(
        (rows, columns), lambda i, j: tvm.te.sum(x[i, k].astype("float32") * w[j, k].astype("float32"), axis=k)
    )
    y = tvm.te.compute((rows, columns), lambda i, j: product[i, j].astype("float16"))
    z = tvm.te.placeholder((rows, columns), "float16", name="z")
    doubled = tvm.te.compute((rows, columns), lambda i, j: z[i, j] + z[i, j])
    return tvm.IRModule({"matmul": tvm.te.create_prim_func([x, w, y]), "add": tvm.te.create_prim_func([z, doubled])})


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="building for cuda needs nvcc (the CUDA toolkit)")
def test_cuda_matmuls_over_dynamic_rows_take_a_gemv_for_few_rows_and_a_tiled_matmul_for_many():
    """A decode step's few rows and a prefill's many run the same function: the row count picks, per bucket, a
    low-batch GEMV or the tiled matmul; a function without a reduction is left to the other rules."""
    module = _dynamic_rows_module()
    target = tvm_target("cuda", "sm_90")
    with target:
        dispatched = low_batch_dispatch(module)
    script = dispatched["matmul"].script()
    limits = [int(m) for m in re.findall(r"tvm_thread_invariant\(n <= T\.int64\((\d+)\)\)", script)]
    assert limits == [limit for limit, _ in LOW_BATCH_BUCKETS]
    assert dispatched["matmul"].attrs["tirx.is_scheduled"]
    assert dispatched["add"].same_as(module["add"])
    with target:
        executable = tvm.compile(tvm.IRModule({"matmul": dispatched["matmul"]}), target=target)
    assert cuda_source(executable).count("__global__") > len(LOW_BATCH_BUCKETS)  # a kernel (or more) per branch


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="building for cuda needs nvcc (the CUDA toolkit)")
def test_experts_and_the_latent_cache_build_for_cuda_in_float16(tiny_checkpoints, tmp_path, elf_arches):
    """DeepSeek-V3's experts (the four expert kernels) and latent cache (the latent kernels) in float16."""
    pipeline = LATENT_PASSES.split(",")
    out = compile_artifact(tiny_checkpoints["deepseek_v3"], tmp_path / "cuda", pipeline, backend="tvm", target="cuda")
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["dtype"] == "float16"
    assert elf_arches((out / manifest["tvm"]["device_code"]["file"]).read_bytes())


def _host_lacks(features):
    """The LLVM features of `features` this CPU does not have (by /proc/cpuinfo)."""
    from llmlower.runtime.cpu_features import CPU_FLAGS, host_cpu_flags

    flags = host_cpu_flags()
    if flags is None:
        pytest.skip("this machine's CPU flags are unknown (no /proc/cpuinfo)")
    return [f for f in features if CPU_FLAGS["x86_64"][f] not in flags]


@pytest.fixture(scope="module")
def portable_artifact(tiny_llama, tmp_path_factory):
    import platform

    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("x86-64-v3 is an x86 CPU level")
    if _host_lacks(["avx2", "fma", "bmi2", "f16c"]):
        pytest.skip("this CPU is not x86-64-v3")
    out = tmp_path_factory.mktemp("artifacts") / "tiny-llama-tvm-v3"
    return compile_artifact(tiny_llama, out, backend="tvm", cpu="x86-64-v3", block_size=8)


def test_a_portable_x86_64_v3_build_runs_here(portable_artifact, artifact):
    from llmlower.runtime import Engine, EngineConfig, SamplingParams

    manifest = json.loads((portable_artifact / "manifest.json").read_text())
    built = manifest["tvm"]
    assert built["cpu"] == "x86-64-v3" and built["triple"].startswith("x86_64")
    assert {"avx2", "fma", "bmi2", "f16c", "movbe"} <= set(built["cpu_features"])
    assert not {"avx512f", "avx512bw"} & set(built["cpu_features"])  # portable: no AVX-512
    default = json.loads((artifact / "manifest.json").read_text())["tvm"]  # this machine's CPU, recorded too
    assert default["cpu"] and "sse2" in default["cpu_features"]
    params = SamplingParams(temperature=0, max_tokens=8)
    tokens = [
        Engine.load(path, EngineConfig(max_num_seqs=1, max_context=64)).generate(["Hello there"], params)[0].token_ids
        for path in (portable_artifact, artifact)
    ]
    assert tokens[0] == tokens[1] and len(tokens[0]) == 8


def test_an_artifact_for_a_cpu_this_machine_is_not_is_refused_before_loading(portable_artifact, tmp_path, capsys):
    """Claims in the manifest of instructions this CPU lacks (as from a library built on a newer server): refused,
    naming them, instead of dying with SIGILL inside a kernel."""
    from llmlower.runtime import Engine
    from llmlower.runtime.artifact import ArtifactError

    candidates = ["amx-tile", "avx512fp16", "amx-fp16", "avx512vp2intersect", "fma4", "xop"]
    missing = _host_lacks(candidates)[:2]
    if not missing:
        pytest.skip("this CPU has every candidate feature")
    copy = shutil.copytree(portable_artifact, tmp_path / "copy")
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["tvm"]["cpu"] = "future-cpu"
    manifest["tvm"]["cpu_features"] += missing
    (copy / "manifest.json").write_text(json.dumps(manifest))
    expected = rf"built for --cpu future-cpu, with instructions this CPU lacks: {', '.join(missing)} \(it would stop"
    with pytest.raises(ArtifactError, match=expected):
        Engine.load(copy)
    assert main(["generate", str(copy), "--prompt", "x"]) == 1
    err = capsys.readouterr().err
    assert missing[0] in err and "x86-64-v3" in err and "Traceback" not in err

    manifest["tvm"]["triple"] = "aarch64-unknown-linux-gnu"
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="its library was built for aarch64 .*; this machine is x86_64"):
        Engine.load(copy)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="building for cuda needs nvcc (the CUDA toolkit)")
def test_a_cuda_artifact_without_a_cuda_device_is_refused(tiny_llama, compiled, capsys):
    import tvm

    from llmlower.runtime import Engine
    from llmlower.runtime.artifact import ArtifactError

    if tvm.cuda(0).exist:
        pytest.skip("this machine has a CUDA device")
    out = compiled(tiny_llama, "tvm", target="cuda", cuda_arch="sm_80")  # the artifact the test above builds
    with pytest.raises(ArtifactError, match="this artifact runs on CUDA, and TVM's runtime here finds no CUDA device"):
        Engine.load(out)
    assert main(["generate", str(out), "--prompt", "x"]) == 1
    err = capsys.readouterr().err
    assert "no CUDA device" in err and "Traceback" not in err


def test_a_detected_cpu_whose_features_this_machine_hides_is_refused_when_compiling(monkeypatch):
    """A VM may report a CPU model while hiding some of its features: building for the detected CPU would give a
    library this very machine cannot run, so the default --cpu is checked before compiling."""
    from llmlower.backends.tvm.compile import check_options, cpu_manifest
    from llmlower.errors import LlmlowerError
    from llmlower.runtime import cpu_features

    features = cpu_manifest(tvm_target("cpu"))["cpu_features"]
    flags = cpu_features.host_cpu_flags()
    if flags is None or "sse2" not in features:
        pytest.skip("needs /proc/cpuinfo on x86")
    monkeypatch.setattr(cpu_features, "host_cpu_flags", lambda: flags - {"sse2"})
    with pytest.raises(LlmlowerError, match=r"this CPU is detected as .*, whose instructions sse2 it lacks"):
        check_options("cpu", {})
    check_options("cpu", {"cpu": "x86-64-v3"})  # an explicit --cpu is the user's choice
    monkeypatch.undo()
    check_options("cpu", {})
