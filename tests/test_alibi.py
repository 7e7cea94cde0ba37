"""ALiBi (Bloom): the eager_attention pass finds attention written out in aten ops and measures its slopes, the
attention ops carry them (`alibi_slopes`), and ONNX Runtime's GroupQueryAttention takes them as its attention_bias;
each checked against transformers' own math. (TVM's kernels: tests/test_tvm_paged_kernels.py; whole models on every
backend: tests/test_architectures.py.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers.models.bloom.modeling_bloom import _get_alibi_slopes

from llmlower.api import compile_artifact
from llmlower.backends.onnx.export import LoweringError
from llmlower.errors import PassError
from llmlower.frontend import capture, load
from llmlower.ir import ATTENTION
from llmlower.passes import run_pipeline

HEADS, KV_HEADS, DK = 4, 2, 8  # conftest's attention_step
MIXED = ([0, 5, 9], [4, 2, 1])  # a prompt, a chunk after a past, a decode (padded to 4)
PREFILL, DECODE = ([0, 0, 0], [4, 2, 3]), ([5, 9, 3], [1, 1, 1])  # the steps GroupQueryAttention takes
SLOPES = _get_alibi_slopes(HEADS, torch.device("cpu"))


class _Attention(torch.nn.Module):
    """One `attention` call with ALiBi slopes, to export it alone."""

    def __init__(self, window: int) -> None:
        super().__init__()
        self.window = window
        self.slopes = torch.nn.Buffer(SLOPES.clone())

    def forward(self, q, k, v, k_cache, v_cache, past_lens, input_lens):
        return ATTENTION.op(
            q, k, v, k_cache, v_cache, past_lens, input_lens, 0.3, self.window, 0.0, None, self.slopes
        )  # fmt: skip


def test_reference_is_blooms_alibi_math(attention_step):
    """Bloom adds slope_h * key position (not key - query) before its mask and float32 softmax: the same weights."""
    args = attention_step(MIXED, DK)
    args.pop("sinks")
    out, k_cache, v_cache = _Attention(0)(*args.values())
    for b, (past, new) in enumerate(zip(*MIXED, strict=True)):
        keys = k_cache[b, :, : past + new].repeat_interleave(HEADS // KV_HEADS, 0)
        values = v_cache[b, :, : past + new].repeat_interleave(HEADS // KV_HEADS, 0)
        alibi = SLOPES[:, None, None] * torch.arange(past + new)  # build_alibi_tensor's, one sequence
        scores = torch.baddbmm(alibi, args["q"][b, :, :new], keys.transpose(-1, -2), alpha=0.3)
        causal = torch.arange(past + new)[None] <= torch.arange(past, past + new)[:, None]
        weights = torch.softmax(scores.masked_fill(~causal, torch.finfo(torch.float32).min), dim=-1)
        torch.testing.assert_close(out[b, :, :new], weights @ values, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [0, 3])
@pytest.mark.parametrize("dv", [DK, 4])
@pytest.mark.parametrize("step", [PREFILL, DECODE], ids=["prefill", "decode"])
def test_onnx_lowering_matches_the_reference(step, dv, window, onnx_session, attention_step):
    """GroupQueryAttention with ALiBi as its attention_bias [batch, heads, tokens, total] (onnxruntime 1.31's CPU
    kernel takes it), the standard-op decomposition where the head sizes differ."""
    args = attention_step(step, dv)
    args.pop("sinks")
    module = _Attention(window)
    inputs = tuple(args.values())
    session, model = onnx_session(module, inputs)
    gqa = [n for n in model.graph.node if n.op_type == "GroupQueryAttention"]
    assert len(gqa) == (dv == DK) and all(len(n.input) == 11 and n.input[10] for n in gqa)
    got = session.run(None, {i.name: x.numpy() for i, x in zip(session.get_inputs(), inputs, strict=True)})
    expected = module(*inputs)
    for b, new in enumerate(step[1]):
        np.testing.assert_allclose(got[0][b, :, :new], expected[0][b, :, :new].numpy(), atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def bloom(tiny_checkpoints):
    return load(tiny_checkpoints["bloom"])


def _attention_calls(program) -> list[torch.fx.Node]:
    return [n for n in program.graph_module.graph.nodes if n.target is ATTENTION.overload]


def test_bloom_loads_eager_and_its_slopes_are_found(bloom):
    """Bloom writes its attention out (baddbmm with the ALiBi tensor, mask, softmax, bmm): it loads with eager
    attention, and each layer's `attention` carries transformers' slopes and 1/sqrt(head_dim), verified."""
    assert bloom.module.config._attn_implementation == "eager"
    assert bloom.spec.max_positions == 2048  # no trained limit in the config: the default context
    program = run_pipeline(capture(bloom), ["canonicalize", "eager_attention", "kv_cache"], verify=True)
    calls = _attention_calls(program)
    assert len(calls) == bloom.spec.num_layers
    for call in calls:
        slopes = getattr(program.graph_module, call.args[11].target)
        assert torch.equal(slopes, _get_alibi_slopes(bloom.spec.num_heads, torch.device("cpu")))
        assert call.args[7] == pytest.approx(bloom.spec.head_dim**-0.5, rel=1e-6) and call.args[9] == 0.0


def test_eager_attention_recognises_llama_run_eagerly(tiny_checkpoints):
    """Not only Bloom: Llama captured with transformers' eager attention (matmul, repeat-kv, mask, softmax in
    float32) becomes `attention` without slopes, and the program still computes transformers' logits."""
    loaded = load(tiny_checkpoints["llama"])
    loaded.module.set_attn_implementation("eager")
    program = run_pipeline(capture(loaded), ["canonicalize", "eager_attention", "kv_cache"], verify=True)
    calls = _attention_calls(program)
    assert len(calls) == loaded.spec.num_layers and all(n.args[11] is None for n in calls)
    tokens = torch.arange(5, 14)[None]
    with torch.no_grad():
        expected = loaded.module(input_ids=tokens).logits[0]
    spec = program.spec
    caches = {t.name: torch.zeros(1, spec.num_kv_heads, 16, spec.head_dim) for t in program.inputs[4:]}
    lens = {"past_lens": torch.tensor([0]), "input_lens": torch.tensor([9])}
    out = program(input_ids=tokens, position_ids=torch.arange(9)[None], **lens, **caches)
    torch.testing.assert_close(out["logits"][0], expected, atol=1e-4, rtol=0)


def _replace_input(program, target, index: int, make) -> str:
    """Give the first `target` node's input `index` the value make(graph, input); the first softmax's name."""
    graph = program.graph_module.graph
    node = next(n for n in graph.nodes if n.target is target)
    with graph.inserting_before(node):
        node.replace_input_with(node.args[index], make(graph, node.args[index]))
    return next(n.name for n in graph.nodes if n.target is torch.ops.aten.softmax.int)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("no_mask", "mask is not causal attention's"),
        ("squared_bias", "bias is not linear in the key position"),
        ("token_bias", "logits come from 2 products"),
    ],
)
def test_a_softmax_attention_it_cannot_map_is_refused_naming_its_softmax(bloom, change, message):
    """Bloom's program changed at its first layer: no causal mask, a bias quadratic in the key position, a bias
    computed from the tokens: each refused in one line naming the softmax, never compiled as something else."""
    aten = torch.ops.aten
    program = run_pipeline(capture(bloom), ["canonicalize"])
    if change == "no_mask":  # the logits without the mask added
        softmax = _replace_input(program, aten.softmax.int, 0, lambda g, x: x.args[0])
    elif change == "squared_bias":  # ALiBi's tensor squared
        square = lambda g, x: g.call_function(aten.mul.Tensor, (x, x))  # noqa: E731
        softmax = _replace_input(program, aten.baddbmm.default, 0, square)
    else:  # q·qᵀ of the same heads added to the logits
        q = next(n for n in program.graph_module.graph.nodes if n.target is aten.baddbmm.default).args[1]
        softmax = _replace_input(
            program,
            aten.baddbmm.default,
            0,
            lambda g, x: g.call_function(aten.bmm.default, (q, g.call_function(aten.transpose.int, (q, 1, 2)))),
        )
    program.graph_module.recompile()
    with pytest.raises(PassError, match=rf"^eager_attention: {softmax}('s)? .*{message}"):
        run_pipeline(program, ["eager_attention"])


def test_onnx_paged_refuses_alibi_naming_the_node(tiny_checkpoints, tmp_path):
    """ONNX Runtime's PagedAttention (the cuda target) has no attention bias input."""
    with pytest.raises(LoweringError, match=r"node paged_attention.*has no attention bias for ALiBi"):
        compile_artifact(tiny_checkpoints["bloom"], tmp_path / "bloom", backend="onnx", target="cuda")
