"""Attention that transformers runs only eagerly (Gemma 2's logit soft-capping, gpt-oss's learned sinks) and
keys / values of different head sizes: captured as one op, carried by the attention op family and lowered by
every backend, each checked against the op's reference (transformers' eager math) and, for Gemma 2 as a whole,
against transformers' own eager generate."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from llmlower.errors import CaptureError
from llmlower.frontend import capture, load
from llmlower.ir import ATTENTION
from llmlower.passes import run_pipeline
from llmlower.runtime import Engine, SamplingParams, Tokenizer

HEADS, KV_HEADS, DK = 4, 2, 8  # conftest's attention_step
MIXED = ([0, 5, 9], [4, 2, 1])  # past_lens, input_lens: a prompt, a chunk after a past, a decode (padded to 4)
# the steps GroupQueryAttention takes: right-padded prompts without a past, decodes (one token each)
PREFILL, DECODE = ([0, 0, 0], [4, 2, 3]), ([5, 9, 3], [1, 1, 1])
# (softcap, sinks, value head size): each extra alone, all together, and none (GroupQueryAttention as before)
EXTRAS = [(0.0, False, DK), (1.5, False, DK), (0.0, True, DK), (1.5, True, DK), (0.0, False, 4), (1.5, True, 12)]


class _Attention(torch.nn.Module):
    """One `attention` call as a module, to export it alone."""

    def __init__(self, scale: float, window: int, softcap: float, sinks: torch.Tensor | None) -> None:
        super().__init__()
        self.scale, self.window, self.softcap = scale, window, softcap
        self.sinks = None if sinks is None else torch.nn.Buffer(sinks)

    def forward(self, q, k, v, k_cache, v_cache, past_lens, input_lens):
        return ATTENTION.op(
            q, k, v, k_cache, v_cache, past_lens, input_lens, self.scale, self.window, self.softcap, self.sinks
        )


def _eager(args: dict[str, torch.Tensor], scale: float, window: int, softcap: float) -> list[torch.Tensor]:
    """transformers' eager attention math, sequence by sequence, on the caches the op should have written:
    gemma2's softcap * tanh(scores / softcap), gpt-oss's sink column dropped after the softmax."""
    outs = []
    k_cache, v_cache = args["k_cache"].clone(), args["v_cache"].clone()
    for b, (past, new) in enumerate(zip(args["past_lens"].tolist(), args["input_lens"].tolist(), strict=True)):
        k_cache[b, :, past : past + new], v_cache[b, :, past : past + new] = (
            args["k"][b, :, :new],
            args["v"][b, :, :new],
        )
        group = HEADS // KV_HEADS
        keys = k_cache[b, :, : past + new].repeat_interleave(group, 0)
        values = v_cache[b, :, : past + new].repeat_interleave(group, 0)
        scores = args["q"][b, :, :new] @ keys.transpose(-1, -2) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        positions, columns = torch.arange(past, past + new)[:, None], torch.arange(past + new)[None]
        allowed = (columns <= positions) & ((columns > positions - window) if window else True)
        scores = scores.masked_fill(~allowed, float("-inf"))
        if args["sinks"] is not None:
            scores = torch.cat([scores, args["sinks"].reshape(-1, 1, 1).expand(-1, new, 1)], dim=-1)
        probs = torch.softmax(scores - scores.max(-1, keepdim=True).values, dim=-1)[..., : past + new]
        outs.append(probs @ values)
    return [outs, k_cache, v_cache]


@pytest.mark.parametrize("window", [0, 3])
@pytest.mark.parametrize(("softcap", "sinks", "dv"), EXTRAS)
def test_reference_is_transformers_eager_math(softcap, sinks, dv, window, attention_step):
    args = attention_step(MIXED, dv, sinks)
    scale = 0.3  # not 1/sqrt(DK)
    out, k_cache, v_cache = ATTENTION.op(
        **{k: v for k, v in args.items() if k != "sinks"},
        scale=scale,
        window=window,
        softcap=softcap,
        sinks=args["sinks"],
    )
    outs, k_expected, v_expected = _eager(args, scale, window, softcap)
    torch.testing.assert_close(k_cache, k_expected)
    torch.testing.assert_close(v_cache, v_expected)
    for b, new in enumerate(MIXED[1]):
        torch.testing.assert_close(out[b, :, :new], outs[b], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("step", [PREFILL, DECODE], ids=["prefill", "decode"])
@pytest.mark.parametrize(("softcap", "sinks", "dv"), EXTRAS)
def test_onnx_lowering_matches_the_reference(softcap, sinks, dv, step, onnx_session, attention_step):
    """GroupQueryAttention with its softcap attribute and head_sink input where the head sizes agree (onnxruntime
    1.31's CPU kernel takes both), the standard-op decomposition where they differ; a sliding window of 3."""
    args = attention_step(step, dv, sinks)
    module = _Attention(0.3, 3, softcap, args.pop("sinks"))
    inputs = tuple(args.values())
    session, model = onnx_session(module, inputs)
    ops = {n.op_type for n in model.graph.node}
    assert ("GroupQueryAttention" in ops) == (dv == DK)
    got = session.run(None, {i.name: x.numpy() for i, x in zip(session.get_inputs(), inputs, strict=True)})
    expected = module(*inputs)
    for b, new in enumerate(step[1]):
        np.testing.assert_allclose(got[0][b, :, :new], expected[0][b, :, :new].numpy(), atol=1e-5, rtol=1e-5)
    for ours, theirs in zip(got[1:], expected[1:], strict=True):
        for b, total in enumerate(np.add(*step)):
            np.testing.assert_allclose(ours[b, :, :total], theirs[b, :, :total].numpy(), atol=1e-6)


# ---------------------------------------------------------------- Gemma 2 as a whole

PROMPTS = ["The quick brown fox", "def add(a, b):\n    return", "caches hold keys and values " * 3]


@pytest.fixture(scope="module")
def gemma2_expected(tiny_checkpoints) -> list[list[int]]:
    """transformers' own greedy tokens for PROMPTS, with its eager attention (the implementation Gemma 2 asks
    for: soft-capping, alternating sliding windows)."""
    path = tiny_checkpoints["gemma2"]
    model = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    tokenizer = Tokenizer.from_dir(path)
    expected = []
    for prompt in PROMPTS:
        ids = torch.tensor([tokenizer.encode(prompt, add_special_tokens=True)])
        out = model.generate(ids, max_new_tokens=10, do_sample=False, eos_token_id=4, pad_token_id=0)
        expected.append(out[0, ids.shape[1] :].tolist())
    return expected


def test_gemma2_loads_with_the_capture_and_its_ops_carry_the_extras(tiny_checkpoints):
    """Gemma 2 refuses SDPA: it loads with llmlower's attention, and every layer's `attention` carries the scale
    1/sqrt(query_pre_attn_scalar), the softcap and the config's alternating windows."""
    loaded = load(tiny_checkpoints["gemma2"])
    assert loaded.module.config._attn_implementation == "llmlower"
    program = run_pipeline(capture(loaded), ["canonicalize", "kv_cache"])
    calls = [n for n in program.graph_module.graph.nodes if n.target is ATTENTION.overload]
    config = loaded.module.config
    assert [n.args[8] for n in calls] == [program.spec.window_for_layer(i) for i in range(len(calls))] == [6, 0]
    assert {(n.args[7], n.args[9]) for n in calls} == {(config.query_pre_attn_scalar**-0.5, 1.0)}


@pytest.mark.parametrize("backend", ["onnx", "tvm", "mlir"])
def test_gemma2_greedy_tokens_equal_transformers_eager_generate(backend, tiny_checkpoints, gemma2_expected, compiled):
    """Three sequences at once, the longest prompt (past the window of 6) split into chunks of at most 16 tokens:
    the artifact's greedy tokens are transformers' own."""
    out = compiled(tiny_checkpoints["gemma2"], backend)
    engine = Engine.load(out, max_num_seqs=3, max_context=64, max_num_batched_tokens=16)
    results = engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=10), chat=False)
    assert len(results[2].prompt_token_ids) > 16  # the long prompt took more than one chunk
    assert [r.token_ids for r in results] == gemma2_expected


# ---------------------------------------------------------------- gpt-oss on the torch reference path


@pytest.fixture(scope="module")
def gpt_oss(tiny_checkpoint_writer, tmp_path_factory) -> Path:
    """conftest's tiny gpt-oss with sink logits large enough to matter."""
    directory = tiny_checkpoint_writer("gpt_oss", tmp_path_factory.mktemp("gpt_oss"))
    model = transformers.AutoModelForCausalLM.from_pretrained(directory)
    for layer in model.model.layers:
        torch.nn.init.normal_(layer.self_attn.sinks, std=2.0)
    model.save_pretrained(directory)
    return directory


def test_gpt_oss_sinks_reach_attention_and_match_transformers_eager(gpt_oss):
    """gpt-oss refuses SDPA: captured with llmlower's attention, its sinks reach every `attention`, and a prompt
    then a decode step on the rewritten program give transformers' eager logits (which the sinks change)."""
    loaded = load(gpt_oss)
    program = run_pipeline(capture(loaded), ["canonicalize", "kv_cache"], verify=True)
    calls = [n for n in program.graph_module.graph.nodes if n.target is ATTENTION.overload]
    assert all(n.args[10] is not None for n in calls) and [n.args[8] for n in calls] == [6, 0]
    eager = transformers.AutoModelForCausalLM.from_pretrained(gpt_oss, attn_implementation="eager").eval()
    tokens = torch.arange(5, 17)[None]
    with torch.no_grad():
        expected = eager(input_ids=tokens).logits[0]
        for layer in eager.model.layers:
            layer.self_attn.sinks.fill_(-1e4)  # no sinks: a different model
        assert (eager(input_ids=tokens).logits[0] - expected).abs().max() > 1e-2
    spec = program.spec
    caches = {t.name: torch.zeros(1, spec.num_kv_heads, 16, spec.head_dim) for t in program.inputs[4:]}
    prompt = dict(input_ids=tokens[:, :11], position_ids=torch.arange(11)[None], past_lens=torch.tensor([0]))
    out = program(**prompt, input_lens=torch.tensor([11]), **caches)
    torch.testing.assert_close(out["logits"][0], expected[:11], atol=1e-4, rtol=0)
    caches = {name: out[name] for name in caches}
    decode = dict(input_ids=tokens[:, 11:], position_ids=torch.tensor([[11]]), past_lens=torch.tensor([11]))
    out = program(**decode, input_lens=torch.tensor([1]), **caches)
    torch.testing.assert_close(out["logits"][0, 0], expected[11], atol=1e-4, rtol=0)


def test_an_unknown_attention_keyword_is_refused_naming_it_and_the_model(tiny_checkpoints):
    loaded = load(tiny_checkpoints["gemma2"])
    with pytest.raises(CaptureError, match=r"^gemma2: attention keyword position_bias=0\.5 has no counterpart"):
        loaded.module(input_ids=torch.tensor([[5, 6, 7]]), position_bias=0.5)
