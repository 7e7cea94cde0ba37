"""A narrow KV cache (compile --kv-cache-dtype int8 or float16): the kv_cache_dtype pass keeps each architecture's
logits within its tolerance in both KV layouts, the ONNX CPU (per-sequence caches), TVM CPU (paged pools) and MLIR
artifacts hold int8 caches (a quarter of float32's bytes), TVM CPU float16 pools for a float32 model (half), and
they serve continuous batching, chunked prefill, preemption, prefix caching and speculative decoding exactly as
they serve each request alone; what cannot take such a cache is refused before anything is compiled."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from llmlower.api import compile_artifact, load_engine, text_perplexity
from llmlower.cli import main
from llmlower.errors import ArgumentError, PassError
from llmlower.frontend.calibration import CALIBRATION_TEXT
from llmlower.passes import DEFAULT_PIPELINE, build_pipeline, run_pipeline, with_kv_layout
from llmlower.runtime import Engine, SamplingParams
from llmlower.runtime.speculative import SpeculativeConfig
from llmlower.step_io import KVLayout

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
CONTEXT = 128
BLOCK = {"onnx": 16, "tvm": 4}  # TVM's pools in small blocks: sequences outgrow them often
BACKENDS = list(BLOCK)
PROMPT_LENGTHS = [5, 40, 9, 23, 3, 31, 14, 7]
ARRIVALS = [0, 0, 1, 2, 3, 5, 6, 8]


def _prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(5, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def int8_artifacts(tiny_llama, tmp_path_factory):
    """The tiny Llama with an int8 cache and a one-layer self-draft, checked against the reference (--verify),
    once per backend: int8_artifacts(backend) -> directory."""
    root, built = tmp_path_factory.mktemp("kv-int8"), {}

    def artifact(backend: str):
        if backend not in built:
            built[backend] = root / backend
            args = ["compile", str(tiny_llama), "-o", str(built[backend]), "--backend", backend, "--recipe", "exact"]
            args += ["--kv-cache-dtype", "int8", "--draft-layers", "1", "--verify"]
            assert main([*args, *(["--block-size", str(BLOCK[backend])] if backend == "tvm" else [])]) == 0
        return built[backend]

    return artifact


@pytest.fixture(scope="module")
def alone(int8_artifacts):
    """Each prompt's greedy tokens on a backend's int8 artifact, served alone: alone(backend) -> token lists."""
    done = {}

    def tokens(backend: str) -> list[list[int]]:
        if backend not in done:
            engine = Engine.load(int8_artifacts(backend), max_context=CONTEXT)
            prompts = _prompts(engine.spec.vocab_size)
            done[backend] = [engine.generate([p], GREEDY, chat=False)[0].token_ids for p in prompts]
        return done[backend]

    return tokens


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma2", "gpt_oss", "bloom", "mistral"])
def test_the_pass_keeps_the_logits_within_its_tolerance(arch, captures, tiny_checkpoints):
    """--verify runs the int8 program against the float one (prompts, logits); every cache becomes int8."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tiny_checkpoints[arch] / "tokenizer.json"))
    calibration = tokenizer.encode(CALIBRATION_TEXT).ids[:256]
    pipeline = [*DEFAULT_PIPELINE, ("kv_cache_dtype", {"calibration": calibration})]
    program = run_pipeline(captures(arch), pipeline, verify=True)
    caches = [t for t in program.inputs if t.name.startswith(("k_cache", "v_cache"))]
    assert caches and {t.dtype for t in caches} == {"int8"}
    assert {t.dtype for t in program.outputs if t.name in {c.name for c in caches}} == {"int8"}
    record = program.history[-1]
    assert record.name == "kv_cache_dtype" and record.stats["int8_caches"] == len(caches)
    assert 0 < record.max_error <= 0.1


@pytest.mark.parametrize("arch", ["llama", "gemma2", "qwen3_5", "falcon_h1"])
def test_the_pass_takes_paged_pools(arch, captures):
    """After paged_attention (TVM's layout): int8 pools, verified on the logits of prompts packed into blocks (a
    hybrid's recurrent state pools beside them, calibrated from zeros)."""
    pipeline = with_kv_layout(DEFAULT_PIPELINE, KVLayout.PAGED, 4)
    calibration = {"calibration": list(range(5, 200))}
    program = run_pipeline(captures(arch), [*pipeline, ("kv_cache_dtype", calibration)], verify=True)
    pools = [t for t in program.inputs if t.name.startswith(("k_pool", "v_pool"))]
    assert pools and {t.dtype for t in pools} == {"int8"}
    assert program.history[-1].name == "kv_cache_dtype" and 0 < program.history[-1].max_error <= 0.1


def test_the_roofline_counts_a_quarter_of_the_kv_bytes(captures, tiny_checkpoints):
    from llmlower.roofline import decode_step, step_cost

    calibration = list(range(5, 200))
    float_cache = run_pipeline(captures("llama"), DEFAULT_PIPELINE)
    int8_cache = run_pipeline(captures("llama"), [*DEFAULT_PIPELINE, ("kv_cache_dtype", {"calibration": calibration})])
    step = decode_step(batch=16, context=100)
    read = [step_cost(p, step).total.kv_read_bytes for p in (float_cache, int8_cache)]
    assert read[1] * 4 == read[0] > 0


def _cache_arrays(engine: Engine) -> list[np.ndarray]:
    """The engine's KV arrays: per-sequence caches [slots, kv_heads, positions, head_dim] or TVM's pools
    [blocks, block_size, kv_heads, head_dim] (as numpy)."""
    executor = engine.executor
    if hasattr(executor, "pools"):
        return [pool.numpy() for pool in executor.pools.values()]
    return [np.asarray(cache) for cache in executor.caches.values()]


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_artifact_keeps_int8_caches_a_quarter_of_float32s_bytes(backend, int8_artifacts):
    manifest = json.loads((int8_artifacts(backend) / "manifest.json").read_text())
    assert manifest["kv_layout"]["dtype"] == "int8"
    assert [step["name"] for step in manifest["pipeline"]][-1] == "kv_cache_dtype"
    engine = Engine.load(int8_artifacts(backend), max_context=CONTEXT, max_num_seqs=2)
    arrays = _cache_arrays(engine)
    assert {a.dtype for a in arrays} == {np.dtype(np.int8)}
    spec = engine.spec
    bytes_per_token = sum(a.nbytes for a in arrays) // (engine.executor.num_blocks * engine.executor.block_size)
    assert bytes_per_token == spec.kv_bytes_per_token("int8") == spec.kv_bytes_per_token("float32") // 4


@pytest.mark.parametrize("backend", BACKENDS)
def test_requests_arriving_under_a_small_pool_get_their_tokens_alone(backend, int8_artifacts, alone, serve):
    """Three slots (ONNX) or 160 positions in blocks of 4 (TVM, which preempts), 16 tokens per step: prompts are
    prefilled in chunks beside the decodes of others."""
    blocks = 3 * CONTEXT // BLOCK[backend] if backend == "onnx" else 160 // BLOCK[backend]
    engine = Engine.load(
        int8_artifacts(backend), max_context=CONTEXT, num_blocks=blocks, max_num_batched_tokens=16, max_num_seqs=8
    )
    results = serve(engine, _prompts(engine.spec.vocab_size), ARRIVALS, GREEDY)
    assert [r.token_ids for r in results] == alone(backend)
    stats = engine.stats()
    assert stats.kv_blocks_used == 0 and (backend == "onnx" or stats.preemptions >= 1)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_cached_prefix_gives_the_tokens_of_a_fresh_prefill(backend, int8_artifacts, alone):
    engine = Engine.load(int8_artifacts(backend), max_context=CONTEXT)
    prompt = _prompts(engine.spec.vocab_size)[1]  # 40 tokens
    first = engine.generate([prompt], GREEDY, chat=False)[0]
    again = engine.generate([prompt], GREEDY, chat=False)[0]
    assert again.usage.cached_tokens == (len(prompt) - 1) // BLOCK[backend] * BLOCK[backend] > 0
    assert first.token_ids == again.token_ids == alone(backend)[1]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("method", ["ngram", "self:1"])
def test_speculative_decoding_gives_the_tokens_of_plain_decoding(backend, method, int8_artifacts, alone):
    config = SpeculativeConfig.parse(method, 3)
    engine = Engine.load(int8_artifacts(backend), max_context=CONTEXT, max_num_seqs=8, speculative=config)
    results = engine.generate(_prompts(engine.spec.vocab_size), GREEDY, chat=False)
    assert [r.token_ids for r in results] == alone(backend)
    assert engine.stats().speculation.accepted > 0


def test_the_backends_hold_the_same_int8_cache(int8_artifacts, tiny_llama, tmp_path):
    """The same pass through torch-mlir's linalg JIT, GroupQueryAttention and TVM's kernels: each verified against
    the reference, the same greedy tokens."""
    mlir = compile_artifact(tiny_llama, tmp_path / "mlir", backend="mlir", kv_cache_dtype="int8", verify=True)
    assert json.loads((mlir / "manifest.json").read_text())["kv_layout"]["dtype"] == "int8"
    prompt = _prompts(256)[3]
    tokens = [
        Engine.load(a, max_context=CONTEXT).generate([prompt], GREEDY, chat=False)[0].token_ids
        for a in (mlir, int8_artifacts("onnx"), int8_artifacts("tvm"))
    ]
    assert tokens[0] == tokens[1] == tokens[2]


def test_what_cannot_take_a_narrow_cache_is_refused_before_compiling(
    tiny_llama, tiny_checkpoints, tmp_path, capsys, monkeypatch
):
    for backend in ("onnx", "tvm"):
        with pytest.raises(ArgumentError, match=f"--backend {backend} --target cuda do not read int8 caches"):
            compile_artifact(tiny_llama, tmp_path / backend, backend=backend, target="cuda", kv_cache_dtype="int8")
    with pytest.raises(
        ArgumentError, match="--target cpu do not read float16 caches of a float32 model; these do: .*tvm --target cpu"
    ):
        compile_artifact(tiny_llama, tmp_path / "f16", backend="onnx", kv_cache_dtype="float16")
    with pytest.raises(ArgumentError, match="a float16 model keeps its cache in float16 or int8"):
        compile_artifact(tiny_llama, tmp_path / "bf16", dtype="float16", kv_cache_dtype="bfloat16")
    with pytest.raises(PassError, match="values have a head size of their own"):
        compile_artifact(tiny_checkpoints["deepseek_v3"], tmp_path / "mla", kv_cache_dtype="int8")
    with pytest.raises(SystemExit):
        main(["compile", str(tiny_llama), "-o", str(tmp_path / "int4"), "--kv-cache-dtype", "int4"])
    assert "--kv-cache-dtype: invalid choice: 'int4'" in capsys.readouterr().err
    monkeypatch.setenv("LLMLOWER_CACHE", str(tmp_path / "cache"))
    assert main(["generate", str(tiny_llama), "--prompt", "x", "--backend", "onnx", "--kv-cache-dtype", "float16"]) == 1
    assert "do not read float16 caches" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # nothing written, not even the artifact cache's directory


@pytest.fixture(scope="module")
def float16_pools(tiny_llama, tmp_path_factory):
    """The tiny Llama on TVM's CPU kernels with float16 pools (a float32 model), checked against the reference."""
    directory = tmp_path_factory.mktemp("kv-f16") / "tvm"
    args = ["compile", str(tiny_llama), "-o", str(directory), "--backend", "tvm", "--block-size", str(BLOCK["tvm"])]
    assert main([*args, "--recipe", "exact", "--kv-cache-dtype", "float16", "--verify"]) == 0
    return directory


def test_float16_pools_hold_half_the_bytes_and_the_references_tokens(float16_pools, tiny_llama):
    """A float32 model's float16 pools: half of float32's bytes per token, and the greedy tokens of the torch
    reference keeping float16 pools (the same rounding of every key and value)."""
    manifest = json.loads((float16_pools / "manifest.json").read_text())
    assert manifest["dtype"] == "float32" and manifest["kv_layout"]["dtype"] == "float16"
    assert manifest["pipeline"][-1]["name"] == "kv_cache_dtype"
    engine = Engine.load(float16_pools, max_context=CONTEXT, max_num_seqs=2)
    arrays = _cache_arrays(engine)
    assert {a.dtype for a in arrays} == {np.dtype(np.float16)}
    bytes_per_token = sum(a.nbytes for a in arrays) // (engine.executor.num_blocks * engine.executor.block_size)
    assert (
        bytes_per_token == engine.spec.kv_bytes_per_token("float16") == engine.spec.kv_bytes_per_token("float32") // 2
    )
    reference = load_engine(tiny_llama, kv_cache_dtype="float16", max_context=CONTEXT)
    assert {a.dtype for a in _cache_arrays(reference)} == {np.dtype(np.float16)}
    for prompt in _prompts(engine.spec.vocab_size)[:3]:
        expected = reference.generate([prompt], GREEDY, chat=False)[0].token_ids
        assert engine.generate([prompt], GREEDY, chat=False)[0].token_ids == expected


def test_float16_pools_serve_arrivals_preemption_and_prefixes_as_alone(float16_pools, serve):
    engine = Engine.load(float16_pools, max_context=CONTEXT)
    prompts = _prompts(engine.spec.vocab_size)
    alone = [engine.generate([p], GREEDY, chat=False)[0].token_ids for p in prompts]
    again = engine.generate([prompts[1]], GREEDY, chat=False)[0]
    assert again.usage.cached_tokens > 0 and again.token_ids == alone[1]
    small = Engine.load(
        float16_pools, max_context=CONTEXT, num_blocks=160 // BLOCK["tvm"], max_num_batched_tokens=16, max_num_seqs=8
    )
    assert [r.token_ids for r in serve(small, prompts, ARRIVALS, GREEDY)] == alone
    assert small.stats().preemptions >= 1 and small.stats().kv_blocks_used == 0


def test_generate_compiles_an_int8_entry_into_the_artifact_cache(int8_artifacts, tiny_llama, tmp_path, monkeypatch):
    """`generate MODEL --kv-cache-dtype int8` compiles MODEL once into a cache entry of its own (the float entry
    stays), whose tokens are those of the artifact `compile --kv-cache-dtype int8` writes; an artifact takes no
    --kv-cache-dtype (it was compiled with its own)."""
    monkeypatch.setenv("LLMLOWER_CACHE", str(tmp_path))
    prompt = "the cache in int8"
    args = ["generate", str(tiny_llama), "--prompt", prompt, "--raw", "--backend", "onnx", "--quant", "none"]
    args += ["--max-tokens", "12", "--ignore-eos", "--json"]
    for kv_cache_dtype in ("auto", "int8"):
        assert main([*args, "--kv-cache-dtype", kv_cache_dtype]) == 0
    entries = {
        json.loads((e / "manifest.json").read_text())["kv_layout"]["dtype"]: e
        for e in (tmp_path / "artifacts").iterdir()
        if e.is_dir()
    }
    assert sorted(entries) == ["float32", "int8"]
    int8_entry = entries["int8"]
    cached = Engine.load(int8_entry, max_context=CONTEXT).generate([prompt], GREEDY, chat=False)[0].token_ids
    compiled = Engine.load(int8_artifacts("onnx"), max_context=CONTEXT).generate([prompt], GREEDY, chat=False)
    assert cached == compiled[0].token_ids
    artifact_args = ["generate", str(int8_artifacts("onnx")), "--prompt", prompt, "--kv-cache-dtype", "int8"]
    assert main(artifact_args) == 1


def test_the_reference_engine_and_perplexity_take_an_int8_cache(int8_artifacts, tiny_llama):
    """The torch reference (generate --backend torch, perplexity) keeps int8 pools, gives the artifacts' tokens,
    and its perplexity stays near the float cache's."""
    engine = load_engine(tiny_llama, kv_cache_dtype="int8", max_context=CONTEXT)
    assert {a.dtype for a in _cache_arrays(engine)} == {np.dtype(np.int8)}
    prompt = _prompts(256)[3]
    artifact = Engine.load(int8_artifacts("onnx"), max_context=CONTEXT)
    expected = artifact.generate([prompt], GREEDY, chat=False)[0].token_ids
    assert engine.generate([prompt], GREEDY, chat=False)[0].token_ids == expected
    text = CALIBRATION_TEXT[::-1]  # other text than the scales were calibrated on
    pipeline = build_pipeline(all_logits=True)
    float_result, _ = text_perplexity(tiny_llama, text, pipeline, window=64)
    int8_result, history = text_perplexity(tiny_llama, text, pipeline, window=64, kv_cache_dtype="int8")
    assert history[-1]["name"] == "kv_cache_dtype"
    assert abs(int8_result.perplexity / float_result.perplexity - 1) < 0.01
