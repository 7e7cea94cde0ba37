"""Paged attention over a caller-owned block pool (backends/tvm/paged_kernels.py), built by the project's Relax
pipeline and run on the Relax VM (llvm, float32) against numpy: two steps over scattered blocks with a shared
prefix, appends written in place into the caller's pools, block copies; MLA's latent attention over pools of
latents and rotary keys against its torch reference; the cuda build (fp16) compiles."""

from __future__ import annotations

import shutil
from dataclasses import dataclass

import numpy as np
import pytest
import torch
import tvm
from tvm import relax, tirx
from tvm.script import tirx as T

from llmlower.backends.tvm.compile import compile_module, cuda_binary, tvm_target
from llmlower.backends.tvm.paged_kernels import (
    NEG,
    emit_copy_blocks,
    emit_paged_attention,
    emit_paged_latent_attention,
    vector_exp,
)
from llmlower.ir import PAGED_ATTENTION
from llmlower.ir.latent_attention import paged_latent_attention

HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS, MAX_BLOCKS = 16, 4, 24, 5
# past lengths and new tokens of the 4 sequences in the first step (prefill from nothing, decode, prefill after a
# shared prefix: sequence 2 forked sequence 1 at 8 tokens and shares its first two blocks, decode), and the new
# tokens of the second step (sequence 1 has none)
PAST, NEW, NEXT = [0, 9, 8, 13], [5, 1, 3, 1], [1, 0, 2, 1]
LATENT_HEADS, NOPE, DV = 4, 12, 10  # MLA's query heads, the query's non-rotary width and the value head size


@dataclass
class Step:
    """One step's inputs: packed rows, the sequences' lengths and block tables."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    tables: np.ndarray
    past: np.ndarray
    starts: np.ndarray


def _module(
    target: tvm.target.Target,
    heads: int,
    kv_heads: int,
    window: int,
    softcap: float = 0.0,
    sinks: np.ndarray | None = None,
    dv: int = HEAD_DIM,
    slopes: np.ndarray | None = None,
) -> tvm.IRModule:
    """`attend(q, k, v, k_pool, v_pool, tables, past, starts)` -> attention output reshaped to [N, heads * dv]
    (an op LegalizeOps/FuseOps see next to ours), and `copy(k_pool, v_pool, src, dst)` -> both pools. softcap,
    sinks and ALiBi slopes (constants) and the value head size dv are the kernels' extras."""
    dtype = "float32" if target.kind.name == "llvm" else "float16"
    n, s, s1, nb, mb, c = (tirx.Var(name, "int64") for name in ("n", "s", "s1", "nb", "mb", "c"))

    def pools() -> list[relax.Var]:
        return [
            relax.Var(name, relax.TensorType([nb, BLOCK_SIZE, kv_heads, d], dtype))
            for name, d in zip("kv", (HEAD_DIM, dv), strict=True)
        ]

    rows = [
        relax.Var(name, relax.TensorType([n, h, d], dtype))
        for name, h, d in zip("qkv", (heads, kv_heads, kv_heads), (HEAD_DIM, HEAD_DIM, dv), strict=True)
    ]
    tables = [
        relax.Var(name, relax.TensorType(shape, "int32"))
        for name, shape in (("tables", [s, mb]), ("past", [s]), ("starts", [s1]))
    ]
    k_pool, v_pool = pools()
    bb = relax.BlockBuilder()
    with bb.function("attend", [*rows, k_pool, v_pool, *tables]):
        with bb.dataflow():
            out = emit_paged_attention(
                bb, *rows, k_pool, v_pool, *tables, heads=heads, kv_heads=kv_heads, head_dim=HEAD_DIM,
                block_size=BLOCK_SIZE, scale=HEAD_DIM**-0.5, window=window, target=target, softcap=softcap,
                sinks=None if sinks is None else relax.const(sinks), value_head_dim=dv,
                alibi_slopes=None if slopes is None else relax.const(slopes),
            )  # fmt: skip
            out = bb.emit_output(relax.op.reshape(out, [n, heads * dv]))
        bb.emit_func_output(out)
    k_pool, v_pool = pools()
    src, dst = (relax.Var(name, relax.TensorType([c], "int32")) for name in ("src", "dst"))
    with bb.function("copy", [k_pool, v_pool, src, dst]):
        with bb.dataflow():
            copies = bb.emit_output(relax.Tuple([emit_copy_blocks(bb, p, src, dst, target) for p in (k_pool, v_pool)]))
        bb.emit_func_output(copies)
    return bb.get()


def _tables(rng: np.random.Generator) -> np.ndarray:
    """Scattered block ids (a permutation of the pool), -1 past each sequence's blocks; sequence 2 shares
    sequence 1's first two blocks (positions 0..7), which no sequence writes."""
    ids = iter(rng.permutation(NUM_BLOCKS))
    tables = np.full((len(PAST), MAX_BLOCKS), -1, "int32")
    for seq, length in enumerate(np.add(PAST, NEW) + NEXT):
        for b in range(-(-length // BLOCK_SIZE)):
            tables[seq, b] = tables[1, b] if seq == 2 and b < 2 else next(ids)
    return tables


def _step(
    rng: np.random.Generator,
    tables: np.ndarray,
    past: list[int],
    new: list[int],
    heads: int,
    kv: int,
    dv: int = HEAD_DIM,
) -> Step:
    """Random rows for sequences with `past` tokens and `new` tokens each (values of head size dv)."""
    n = sum(new)
    q, k, v = (
        rng.standard_normal((n, h, d)).astype("float32") for h, d in ((heads, HEAD_DIM), (kv, HEAD_DIM), (kv, dv))
    )
    return Step(q, k, v, tables, np.array(past, "int32"), np.cumsum([0, *new]).astype("int32"))


def _reference(step: Step, k_pool: np.ndarray, v_pool: np.ndarray, window: int) -> np.ndarray:
    """Append into the pools (in place) and attend in float64 over each row's causal positions (within a sliding
    window or, window < 0, its own chunk)."""
    heads, group = step.q.shape[1], step.q.shape[1] // k_pool.shape[2]
    out = np.zeros_like(step.q)
    for seq, past in enumerate(step.past):
        for row in range(step.starts[seq], step.starts[seq + 1]):
            pos = past + row - step.starts[seq]
            block = step.tables[seq, pos // BLOCK_SIZE]
            k_pool[block, pos % BLOCK_SIZE], v_pool[block, pos % BLOCK_SIZE] = step.k[row], step.v[row]
    for seq, past in enumerate(step.past):
        for row in range(step.starts[seq], step.starts[seq + 1]):
            pos = past + row - step.starts[seq]
            first = max(pos - window + 1, 0) if window > 0 else pos - pos % -window if window < 0 else 0
            j = np.arange(first, pos + 1)
            blocks, offsets = step.tables[seq, j // BLOCK_SIZE], j % BLOCK_SIZE
            keys, values = k_pool[blocks, offsets].astype("float64"), v_pool[blocks, offsets].astype("float64")
            for h in range(heads):
                scores = keys[:, h // group] @ step.q[row, h] * HEAD_DIM**-0.5
                weights = np.exp(scores - scores.max())
                out[row, h] = weights / weights.sum() @ values[:, h // group]
    return out


@pytest.mark.parametrize(("heads", "kv_heads", "window"), [(6, 2, 0), (6, 2, 5), (4, 4, 0), (6, 2, -4)])
def test_attention_appends_in_place_and_matches_numpy(heads: int, kv_heads: int, window: int) -> None:
    target = tvm_target("cpu")
    vm = relax.VirtualMachine(compile_module(_module(target, heads, kv_heads, window), target), tvm.cpu())
    rng = np.random.default_rng(window + heads)
    tables = _tables(rng)
    k_pool, v_pool = (rng.standard_normal((NUM_BLOCKS, BLOCK_SIZE, kv_heads, HEAD_DIM)).astype("float32") for _ in "kv")
    pools = [tvm.runtime.tensor(pool) for pool in (k_pool, v_pool)]
    # a mixed prefill/decode step, then a step reading what the first appended
    for past, new in ((PAST, NEW), (list(np.add(PAST, NEW)), NEXT)):
        step = _step(rng, tables, past, new, heads, kv_heads)
        expected = _reference(step, k_pool, v_pool, window)
        args = [step.q, step.k, step.v, *pools, step.tables, step.past, step.starts]
        out = vm["attend"](*(a if isinstance(a, tvm.runtime.Tensor) else tvm.runtime.tensor(a) for a in args))
        assert np.abs(out.numpy().reshape(expected.shape) - expected).max() <= 1e-5
        assert np.array_equal(pools[0].numpy(), k_pool) and np.array_equal(pools[1].numpy(), v_pool)


def test_copy_blocks_in_place() -> None:
    target = tvm_target("cpu")
    vm = relax.VirtualMachine(compile_module(_module(target, 6, 2, 0), target), tvm.cpu())
    rng = np.random.default_rng(1)
    pools = [rng.standard_normal((NUM_BLOCKS, BLOCK_SIZE, 2, HEAD_DIM)).astype("float32") for _ in "kv"]
    tensors = [tvm.runtime.tensor(pool) for pool in pools]
    src, dst = np.array([3, 17, 0], "int32"), np.array([9, 2, 21], "int32")
    vm["copy"](*tensors, tvm.runtime.tensor(src), tvm.runtime.tensor(dst))
    for pool, tensor in zip(pools, tensors, strict=True):
        pool[dst] = pool[src]
        assert np.array_equal(tensor.numpy(), pool)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_cuda_build() -> None:
    target = tvm_target("cuda", "sm_80")
    slopes = np.geomspace(0.5, 0.5**6, 6).astype("float32")  # ALiBi's CUDA path compiles too
    source, fatbin = cuda_binary(compile_module(_module(target, 6, 2, 5, slopes=slopes), target), target)
    assert all(f"{name}_kernel" in source for name in ("paged_append", "paged_attention", "copy_blocks"))
    assert fatbin


@pytest.mark.parametrize(
    ("softcap", "sinks", "dv", "alibi", "window"),
    [
        (1.5, False, HEAD_DIM, False, 5),
        (0.0, True, HEAD_DIM, False, 5),
        (0.0, False, 8, False, 5),
        (1.5, True, 24, False, 5),
        (0.0, False, HEAD_DIM, True, 0),
        (0.0, False, HEAD_DIM, True, 5),
        (1.5, True, 24, True, 0),
        (1.5, True, HEAD_DIM, False, -6),  # chunked local attention
    ],
)
def test_extras_match_the_paged_attention_reference(
    softcap: float, sinks: bool, dv: int, alibi: bool, window: int
) -> None:
    """Soft-capping, sink logits (in the online softmax's starting state), values of their own head size and ALiBi
    slopes (slope * (key - query) on each logit; Bloom's slopes for 6 heads): the kernels against the op's torch
    reference (ir/paged_attention.py), two steps, with and without a sliding window of 5."""
    heads, kv_heads = 6, 2
    rng = np.random.default_rng(7)
    sink_logits = rng.standard_normal(heads).astype("float32") if sinks else None
    slopes = np.geomspace(0.5, 0.5**6, heads).astype("float32") if alibi else None
    target = tvm_target("cpu")
    module = _module(target, heads, kv_heads, window, softcap, sink_logits, dv, slopes)
    vm = relax.VirtualMachine(compile_module(module, target), tvm.cpu())
    tables = _tables(rng)
    k_pool, v_pool = (
        rng.standard_normal((NUM_BLOCKS, BLOCK_SIZE, kv_heads, d)).astype("float32") for d in (HEAD_DIM, dv)
    )
    pools = [tvm.runtime.tensor(pool) for pool in (k_pool, v_pool)]
    for past, new in ((PAST, NEW), (list(np.add(PAST, NEW)), NEXT)):
        step = _step(rng, tables, past, new, heads, kv_heads, dv)
        step.q *= 3  # logits large enough for the cap to bend them
        packed = [torch.from_numpy(x).transpose(0, 1)[None] for x in (step.q, step.k, step.v)]  # [1, h, N, d]
        expected, k_pool, v_pool = PAGED_ATTENTION.op(
            *packed, torch.from_numpy(k_pool), torch.from_numpy(v_pool), torch.from_numpy(tables).long(),
            torch.tensor(past), torch.tensor(new), HEAD_DIM**-0.5, window, softcap,
            None if sink_logits is None else torch.from_numpy(sink_logits),
            None if slopes is None else torch.from_numpy(slopes),
        )  # fmt: skip
        expected, k_pool, v_pool = expected[0].transpose(0, 1).numpy(), k_pool.numpy(), v_pool.numpy()
        args = [step.q, step.k, step.v, *pools, step.tables, step.past, step.starts]
        out = vm["attend"](*(a if isinstance(a, tvm.runtime.Tensor) else tvm.runtime.tensor(a) for a in args))
        assert np.abs(out.numpy().reshape(expected.shape) - expected).max() <= 1e-5
        assert np.array_equal(pools[0].numpy(), k_pool) and np.array_equal(pools[1].numpy(), v_pool)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "softcap", "sinks", "alibi", "window"),
    [
        (6, 2, 0.0, False, False, 0),
        (6, 2, 1.5, True, True, 7),
        (6, 2, 0.0, False, True, 0),
        (4, 4, 0.0, True, False, 9),
        (4, 2, 0.0, True, False, 0),
        (6, 2, 0.0, False, False, -24),  # chunks of 24: tiles of rows cross a chunk's start
    ],
)
def test_long_prompt_chunks_and_lone_decode_rows_match_the_paged_attention_reference(
    heads: int, kv_heads: int, softcap: float, sinks: bool, alibi: bool, window: int
) -> None:
    """Prompt chunks longer than the CPU kernel's tiles of rows (16 rows of 3 query heads, 64 rows of 1): whole
    tiles, a short last one and a last row alone, beside a decode row; and steps of one and three decode rows over
    long contexts, whose keys the kernel splits into ranges and merges: against the op's torch reference."""
    rng = np.random.default_rng(11)
    sink_logits = rng.standard_normal(heads).astype("float32") if sinks else None
    slopes = np.geomspace(0.5, 0.5**heads, heads).astype("float32") if alibi else None
    target = tvm_target("cpu")
    module = _module(target, heads, kv_heads, window, softcap, sink_logits, HEAD_DIM, slopes)
    vm = relax.VirtualMachine(compile_module(module, target), tvm.cpu())
    for past, new in (([3, 0, 20], [37, 33, 1]), ([100], [1]), ([70, 2, 121], [1, 1, 1])):
        lengths = np.add(past, new)
        per_sequence = -(-lengths.max() // BLOCK_SIZE)
        tables = rng.permutation(len(past) * per_sequence).astype("int32").reshape(len(past), per_sequence)
        k_pool, v_pool = (
            rng.standard_normal((tables.size, BLOCK_SIZE, kv_heads, HEAD_DIM)).astype("float32") for _ in range(2)
        )
        pools = [tvm.runtime.tensor(pool) for pool in (k_pool, v_pool)]
        step = _step(rng, tables, past, new, heads, kv_heads)
        step.q *= 3
        packed = [torch.from_numpy(x).transpose(0, 1)[None] for x in (step.q, step.k, step.v)]
        expected, _, _ = PAGED_ATTENTION.op(
            *packed, torch.from_numpy(k_pool), torch.from_numpy(v_pool), torch.from_numpy(tables).long(),
            torch.tensor(past), torch.tensor(new), HEAD_DIM**-0.5, window, softcap,
            None if sink_logits is None else torch.from_numpy(sink_logits),
            None if slopes is None else torch.from_numpy(slopes),
        )  # fmt: skip
        args = [step.q, step.k, step.v, *pools, step.tables, step.past, step.starts]
        out = vm["attend"](*(a if isinstance(a, tvm.runtime.Tensor) else tvm.runtime.tensor(a) for a in args))
        expected = expected[0].transpose(0, 1).numpy()
        assert np.abs(out.numpy().reshape(expected.shape) - expected).max() <= 1e-5, (past, new)


def _latent_module(target: tvm.target.Target, rank: int, rope: int, window: int) -> tvm.IRModule:
    """`attend(q, latent, k_pe, kv_weight, c_pool, pe_pool, tables, past, starts)` -> MLA's output [N, heads, dv]
    over pools of latents [nb, BLOCK_SIZE, 1, rank] and rotary keys [..., rope] (updated in place)."""
    dtype = "float32" if target.kind.name == "llvm" else "float16"
    n, s, s1, nb, mb = (tirx.Var(name, "int64") for name in ("n", "s", "s1", "nb", "mb"))
    shapes = {
        "q": [n, LATENT_HEADS, NOPE + rope],
        "latent": [n, 1, rank],
        "k_pe": [n, 1, rope],
        "kv_weight": [LATENT_HEADS * (NOPE + DV), rank],
        "c_pool": [nb, BLOCK_SIZE, 1, rank],
        "pe_pool": [nb, BLOCK_SIZE, 1, rope],
    }
    params = [relax.Var(name, relax.TensorType(shape, dtype)) for name, shape in shapes.items()]
    params += [
        relax.Var(name, relax.TensorType(shape, "int32"))
        for name, shape in (("tables", [s, mb]), ("past", [s]), ("starts", [s1]))
    ]
    bb = relax.BlockBuilder()
    with bb.function("attend", params):
        with bb.dataflow():
            out = emit_paged_latent_attention(bb, *params, scale=0.3, window=window, target=target)
            out = bb.emit_output(out)
        bb.emit_func_output(out)
    return bb.get()


@pytest.mark.parametrize(("rank", "rope", "window"), [(16, 8, 0), (16, 8, 5), (12, 4, 0)])
def test_latent_attention_matches_the_paged_latent_attention_reference(rank: int, rope: int, window: int) -> None:
    """The latent kernels (query absorbed through kv_weight, keys [c | k_pe] read from both pools, values c,
    output through kv_weight's value rows) against the op's torch reference: a mixed prefill/decode step of 4
    sequences over scattered blocks, then a step reading what it appended; the appends land in the caller's
    pools."""
    target = tvm_target("cpu")
    vm = relax.VirtualMachine(compile_module(_latent_module(target, rank, rope, window), target), tvm.cpu())
    rng = np.random.default_rng(rank + rope + window)
    tables = _tables(rng)
    weight = (rng.standard_normal((LATENT_HEADS * (NOPE + DV), rank)) / 4).astype("float32")
    c_pool, pe_pool = (rng.standard_normal((NUM_BLOCKS, BLOCK_SIZE, 1, d)).astype("float32") for d in (rank, rope))
    pools = [tvm.runtime.tensor(pool) for pool in (c_pool, pe_pool)]
    for past, new in ((PAST, NEW), (list(np.add(PAST, NEW)), NEXT)):
        n = sum(new)
        q, latent, k_pe = (
            rng.standard_normal((n, h, d)).astype("float32")
            for h, d in ((LATENT_HEADS, NOPE + rope), (1, rank), (1, rope))
        )
        packed = [torch.from_numpy(x).transpose(0, 1)[None] for x in (q, latent, k_pe)]  # [1, heads, N, d]
        expected, c_pool, pe_pool = paged_latent_attention(
            *packed, torch.from_numpy(weight), torch.from_numpy(c_pool), torch.from_numpy(pe_pool),
            torch.from_numpy(tables).long(), torch.tensor(past), torch.tensor(new), 0.3, window,
        )  # fmt: skip
        expected, c_pool, pe_pool = expected[0].transpose(0, 1).numpy(), c_pool.numpy(), pe_pool.numpy()
        steps = [np.array(past, "int32"), np.cumsum([0, *new]).astype("int32")]
        args = [tvm.runtime.tensor(x) for x in (q, latent, k_pe, weight)] + pools
        args += [tvm.runtime.tensor(x) for x in (tables, *steps)]
        out = vm["attend"](*args)
        assert np.abs(out.numpy() - expected).max() <= 1e-5
        assert np.array_equal(pools[0].numpy(), c_pool) and np.array_equal(pools[1].numpy(), pe_pool)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_latent_cuda_build() -> None:
    target = tvm_target("cuda", "sm_80")
    source, fatbin = cuda_binary(compile_module(_latent_module(target, 16, 8, 5), target), target)
    assert all(f"{name}_kernel" in source for name in ("paged_append", "paged_attention", "latent_absorb"))
    assert fatbin


def test_the_softmax_exponential_is_exact_to_float32_and_zero_for_masked_logits() -> None:
    """The CPU kernels' vectorized exp: within 1e-7 of exp over the softmax's arguments (<= 0), 0 for NEG."""

    @T.prim_func
    def exp_of(x: T.Buffer((1024,), "float32"), y: T.Buffer((1024,), "float32")):
        for i in T.vectorized(1024):
            y[i] = vector_exp(x[i])

    x = np.concatenate([np.linspace(-87, 0, 1020), [NEG, -100.0, -88.5, 0.0]]).astype(np.float32)
    y = tvm.runtime.tensor(np.empty_like(x))
    tvm.compile(exp_of, target="llvm")(tvm.runtime.tensor(x), y)
    exact = np.exp(x.astype(np.float64))
    np.testing.assert_allclose(y.numpy()[:1020], exact[:1020], rtol=1e-7, atol=0)
    assert y.numpy()[1020:].tolist() == [0.0, 0.0, 0.0, 1.0]
