"""Hybrid models' recurrent layers: the ops that carry a per-sequence state across steps, the state_cache pass that
finds them in the captured graph, and an engine that keeps, forks and rolls back the state."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from llmlower.errors import GenerationError
from llmlower.frontend import capture, load
from llmlower.ir import CAUSAL_CONV1D, GATED_DELTA_RULE, GATED_DELTA_STEP, SELECTIVE_SCAN, SELECTIVE_STEP, SSD_STEP
from llmlower.passes import FUSION, run_pipeline
from llmlower.runtime import Engine, SamplingParams
from llmlower.runtime.engine import EngineConfig
from llmlower.runtime.speculative import SpeculativeConfig

CHANNELS, WIDTH = 6, 4


def _conv_inputs(batch: int, tokens: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, CHANNELS, tokens, generator=gen)
    weight = torch.randn(CHANNELS, WIDTH, generator=gen)
    bias = torch.randn(CHANNELS, generator=gen)
    return x, weight, bias


def _whole_prompt(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """The causal convolution as the models write it over a whole prompt: padded by width - 1, cut back."""
    conv = torch.nn.functional.conv1d(x, weight.unsqueeze(1), bias, padding=WIDTH - 1, groups=CHANNELS)
    return conv[..., : x.shape[-1]]


@pytest.mark.parametrize("chunks", [[9], [3, 4, 2], [1] * 9, [2, 1, 6]])
def test_causal_conv1d_in_chunks_equals_the_whole_prompt(chunks):
    x, weight, bias = _conv_inputs(2, sum(chunks))
    state = torch.randn(2, CHANNELS, WIDTH - 1)  # a slot's leftovers: a fresh sequence must not read them
    outputs, past = [], 0
    for size in chunks:
        lens = torch.tensor([size, size])
        out, state = CAUSAL_CONV1D.op(x[..., past : past + size], weight, bias, state, torch.tensor([past] * 2), lens)
        outputs.append(out)
        past += size
    torch.testing.assert_close(torch.cat(outputs, dim=-1), _whole_prompt(x, weight, bias))
    torch.testing.assert_close(state, x[..., -(WIDTH - 1) :])  # the last width - 1 inputs


def test_causal_conv1d_keeps_each_rows_state_at_its_own_last_token():
    """Right-padded rows: a row's new state ends at its last real token (shorter than the window: part old state)."""
    x, weight, bias = _conv_inputs(3, 5, seed=1)
    state = torch.randn(3, CHANNELS, WIDTH - 1)
    past, lens = torch.tensor([4, 0, 7]), torch.tensor([5, 3, 1])
    out, updated = CAUSAL_CONV1D.op(x, weight, bias, state, past, lens)
    for row in range(3):
        window = state[row] if past[row] else torch.zeros_like(state[row])
        full = torch.cat((window, x[row, :, : lens[row]]), dim=-1)
        torch.testing.assert_close(updated[row], full[:, -(WIDTH - 1) :])
        expected = torch.nn.functional.conv1d(full[None], weight.unsqueeze(1), bias, groups=CHANNELS)[0]
        torch.testing.assert_close(out[row, :, : lens[row]], expected)


class _Conv(torch.nn.Module):
    def forward(self, x, weight, bias, state, past_lens, input_lens):
        return CAUSAL_CONV1D.op(x, weight, bias, state, past_lens, input_lens)


def test_causal_conv1d_onnx_lowering_matches_the_reference(onnx_session):
    x, weight, bias = _conv_inputs(3, 5, seed=2)
    inputs = (x, weight, bias, torch.randn(3, CHANNELS, WIDTH - 1), torch.tensor([4, 0, 7]), torch.tensor([5, 3, 1]))
    session, model = onnx_session(_Conv(), inputs)
    assert {"Conv", "GatherElements"} <= {node.op_type for node in model.graph.node}
    got = session.run(None, {i.name: t.numpy() for i, t in zip(session.get_inputs(), inputs, strict=True)})
    expected = _Conv()(*inputs)
    for row, length in enumerate([5, 3, 1]):
        np.testing.assert_allclose(got[0][row, :, :length], expected[0][row, :, :length].numpy(), atol=1e-5)
    np.testing.assert_allclose(got[1], expected[1].numpy(), atol=1e-6)


@pytest.fixture(scope="module")
def lfm2(tiny_checkpoints):
    return load(tiny_checkpoints["lfm2"])


def test_state_cache_finds_the_short_convolutions_in_the_graph(lfm2):
    """LFM2's layers 0 and 2 are convolutions, layer 1 attention: each keeps what its layer needs, by layer."""
    program = run_pipeline(capture(lfm2), ["canonicalize", *FUSION, "state_cache", "kv_cache"], verify=True)
    states, caches = ["conv_state_0", "conv_state_2"], ["k_cache_1", "v_cache_1"]
    assert program.input_names == ["input_ids", "position_ids", "past_lens", "input_lens", *states, *caches]
    assert program.output_names == ["logits", *states, *caches]
    assert program.history[-2].stats["conv"] == 2
    assert program.spec.kv_widths == (0, 2 * 2 * 16, 0) and program.spec.state_bytes == 2 * 64 * 2 * 4
    assert all(record.max_error < 1e-5 for record in program.history)


def test_a_dense_model_is_left_unchanged(tiny_checkpoints):
    program = capture(load(tiny_checkpoints["llama"]))
    nodes = len(program.graph_module.graph.nodes)
    program = run_pipeline(program, ["state_cache"])
    assert program.history[-1].stats["conv"] == 0 and len(program.graph_module.graph.nodes) == nodes


@pytest.mark.parametrize("options", [{"awq": True}, {"gptq": True}], ids=["awq", "gptq"])
def test_calibrated_passes_run_on_a_hybrid_model(tiny_checkpoints, options):
    """AWQ, GPTQ and an int8 KV cache run the program on calibration text, its recurrent states included (int4 on
    a tiny random model is too coarse to verify against float: the program is run instead)."""
    from llmlower.api import compile_program, with_kv_cache_dtype
    from llmlower.ir.program import example_inputs
    from llmlower.passes import build_pipeline

    pipeline = with_kv_cache_dtype(build_pipeline(quant="q4g32", **options), "int8", "float32")
    _, program = compile_program(tiny_checkpoints["qwen3_5"], pipeline)
    assert {record.name for record in program.history} >= {"state_cache", "kv_cache_dtype", *options}
    outputs = program(**example_inputs(program, batch=2, tokens=3, context=8))
    assert all(bool(value.isfinite().all()) for value in outputs.values())


@pytest.fixture(scope="module")
def lfm2_onnx(tiny_checkpoints, compiled):
    return compiled(tiny_checkpoints["lfm2"], "onnx")


REPEATING = "caches hold caches hold caches hold caches hold"


def test_rejected_guesses_roll_the_state_back(lfm2_onnx, tiny_checkpoints, greedy_reference):
    """Prompt lookup guesses on a repeating prompt; a rejected guess must leave no trace in the conv state."""
    speculative = SpeculativeConfig("ngram", num_tokens=3, ngram_min=1)
    engine = Engine.load(lfm2_onnx, max_num_seqs=4, max_context=128, max_num_batched_tokens=32, speculative=speculative)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    results = engine.generate([REPEATING, "The quick brown fox"], params, chat=False)
    for result in results:
        assert result.token_ids == greedy_reference(tiny_checkpoints["lfm2"], result.prompt_token_ids, 16)
    stats = engine.stats().speculation
    assert stats.proposed > stats.accepted > 0  # some guesses kept, some rolled back
    assert engine.stats().kv_blocks_used == 0


def test_prefix_caching_is_off_for_a_recurrent_state(lfm2_onnx, tiny_checkpoints, greedy_reference):
    """A cached prefix holds KV entries, not the state after it: the same prompt twice is computed twice."""
    engine = Engine.load(lfm2_onnx, max_num_seqs=2, max_context=128, enable_prefix_caching=True)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompt = REPEATING * 2  # longer than a block
    first, second = (engine.generate([prompt], params, chat=False)[0] for _ in range(2))
    assert first.token_ids == second.token_ids
    assert engine.stats().prefix_cache_queries == 0 and second.usage.cached_tokens == 0


def test_a_draft_model_with_a_state_is_refused(lfm2_onnx):
    engine = Engine.load(lfm2_onnx, max_num_seqs=2, max_context=128)
    config = EngineConfig(max_num_seqs=2, speculative=SpeculativeConfig("draft", draft=lfm2_onnx))
    with pytest.raises(GenerationError, match="recurrent state"):
        Engine(engine.executor, engine.tokenizer, engine.spec, config=config, draft=engine.executor)


HK, HV, DK, DV = 2, 4, 8, 6


def _delta_inputs(batch: int, tokens: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """q, k [batch, tokens, HK, DK], v [.., HV, DV], g (a log decay) and beta [.., HV], as the models make them."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(batch, tokens, HK, DK, generator=gen) for _ in range(2))
    v = torch.randn(batch, tokens, HV, DV, generator=gen)
    g = -torch.nn.functional.softplus(torch.randn(batch, tokens, HV, generator=gen))
    beta = torch.rand(batch, tokens, HV, generator=gen)
    return q, k, v, g, beta


@pytest.mark.parametrize("tokens", [1, 11, 150], ids=["decode", "one-chunk", "three-chunks"])
@pytest.mark.parametrize("function", ["torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"])
def test_delta_step_equals_transformers_delta_rule(function, tokens):
    """Both of transformers' implementations (chunked for prompts, recurrent for decode), from a given state: our
    recurrence (one token) and our chunked form (a prompt, across chunk boundaries)."""
    from transformers.models.qwen3_5 import modeling_qwen3_5

    q, k, v, g, beta = _delta_inputs(2, tokens)
    state = torch.randn(2, HV, DK, DV)
    lens = torch.tensor([tokens, tokens])
    ours, ours_state = GATED_DELTA_STEP.op(q, k, v, g, beta, state, torch.tensor([3, 3]), lens, True)
    theirs, theirs_state = getattr(modeling_qwen3_5, function)(
        q, k, v, g=g, beta=beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ours_state, theirs_state, atol=1e-4, rtol=1e-4)
    whole, _ = getattr(modeling_qwen3_5, function)(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(GATED_DELTA_RULE.op(q, k, v, g, beta, True), whole, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("chunks", [[7], [3, 1, 3], [1] * 7])
def test_delta_step_in_chunks_equals_the_whole_prompt(chunks):
    q, k, v, g, beta = _delta_inputs(1, sum(chunks), seed=1)
    whole = GATED_DELTA_RULE.op(q, k, v, g, beta, False)
    state = torch.randn(1, HV, DK, DV)  # a slot's leftovers
    outputs, past = [], 0
    for size in chunks:
        part = [x[:, past : past + size] for x in (q, k, v, g, beta)]
        out, state = GATED_DELTA_STEP.op(*part, state, torch.tensor([past]), torch.tensor([size]), False)
        outputs.append(out)
        past += size
    torch.testing.assert_close(torch.cat(outputs, dim=1), whole, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tokens", [1, 11, 150], ids=["decode", "one-chunk", "three-chunks"])
def test_ssd_step_equals_transformers_mamba2_scan(tokens):
    """Mamba-2's chunked scan (chunks of 4) from a given state, with D, dt_bias and softplus: our recurrence (one
    token) and our chunked form (a prompt, across chunk boundaries)."""
    from transformers.models.granitemoehybrid import modeling_granitemoehybrid

    gen = torch.Generator().manual_seed(3)
    heads, head_dim, groups, state_size = 4, 6, 2, 5
    x = torch.randn(2, tokens, heads, head_dim, generator=gen)
    dt, A = torch.randn(2, tokens, heads, generator=gen), -torch.rand(heads, generator=gen)
    B, C = (torch.randn(2, tokens, groups, state_size, generator=gen) for _ in range(2))
    D, dt_bias = torch.randn(heads, generator=gen), torch.randn(heads, generator=gen)
    state = torch.randn(2, heads, head_dim, state_size, generator=gen)
    limits = (0.0, float("inf"))
    lens, past = torch.tensor([tokens, tokens]), torch.tensor([2, 2])
    ours, ours_state = SSD_STEP.op(x, dt, A, B, C, D, dt_bias, state, past, lens, True, *limits)
    theirs, theirs_state = modeling_granitemoehybrid.mamba2_chunk_scan(
        x, dt, A, B, C, chunk_size=4, D=D, dt_bias=dt_bias, initial_states=state, dt_softplus=True,
        dt_limit=limits, return_final_states=True,
    )  # fmt: skip
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ours_state, theirs_state, atol=1e-4, rtol=1e-4)


def test_selective_scan_equals_transformers_mamba_scan():
    """Mamba's selective scan with D, the silu(z) gate, dt_bias and softplus, from zeros (transformers' torch path
    takes no initial state); the step's state is the scan's last."""
    from transformers.models.jamba import modeling_jamba

    gen = torch.Generator().manual_seed(4)
    channels, state_size, tokens = 6, 5, 9
    x, dt, z = (torch.randn(2, channels, tokens, generator=gen) for _ in range(3))
    A = -torch.rand(channels, state_size, generator=gen)
    B, C = (torch.randn(2, state_size, tokens, generator=gen) for _ in range(2))
    D, dt_bias = torch.randn(channels, generator=gen), torch.randn(channels, generator=gen)
    theirs, theirs_state = modeling_jamba.mamba_selective_scan(
        x, dt, A, B, C, D=D, z=z, delta_bias=dt_bias, delta_softplus=True, return_last_state=True
    )
    torch.testing.assert_close(SELECTIVE_SCAN.op(x, dt, A, B, C, D, z, dt_bias, True), theirs, atol=1e-5, rtol=1e-5)
    state, zero, lens = torch.randn(2, channels, state_size), torch.tensor([0, 0]), torch.tensor([tokens, tokens])
    ours, ours_state = SELECTIVE_STEP.op(x, dt, A, B, C, D, z, dt_bias, state, zero, lens, True)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours_state, theirs_state, atol=1e-5, rtol=1e-5)


class _Step(torch.nn.Module):
    """One recurrent op with its constant arguments bound, as a module to export."""

    def __init__(self, op, **constants) -> None:
        super().__init__()
        self.op, self.constants = op, constants

    def forward(self, *tensors):
        return self.op(*tensors, **self.constants)


def _onnx_loop_matches(module: _Step, inputs: tuple, tokens_axis: dict[int, int], lens: list[int]) -> None:
    """Export `module` with the step's tokens dynamic (input position -> its tokens axis), expand its Loop, and run
    it in ONNX Runtime against the reference: outputs at each row's real tokens, and the state."""
    import onnxruntime as ort

    from llmlower.backends.onnx.lowerings import translations
    from llmlower.backends.onnx.token_loops import expand_token_loops

    tokens = torch.export.Dim("tokens", min=1, max=512)
    shapes = tuple({tokens_axis[i]: tokens} if i in tokens_axis else None for i in range(len(inputs)))
    # exported from twice the tokens (an example of one token would fix the count at 1), run on the given ones
    example = tuple(torch.cat((t, t), dim=tokens_axis[i]) if i in tokens_axis else t for i, t in enumerate(inputs))
    exported = torch.export.export(module, example, dynamic_shapes=(shapes,))
    model = torch.onnx.export(exported, custom_translation_table=translations(), dynamo=True, verbose=False).model_proto
    assert expand_token_loops(model) == 1 and {node.op_type for node in model.graph.node} & {"Loop", "If"}
    model.ir_version = min(model.ir_version, 10)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = [t for t in inputs if t is not None]
    got = session.run(None, {i.name: t.numpy() for i, t in zip(session.get_inputs(), feeds, strict=True)})
    expected = module(*inputs)
    axis = tokens_axis[0]
    for row, length in enumerate(lens):
        ours, theirs = got[0][row].swapaxes(0, axis - 1), expected[0][row].numpy().swapaxes(0, axis - 1)
        np.testing.assert_allclose(ours[:length], theirs[:length], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(got[1], expected[1].numpy(), atol=1e-5, rtol=1e-5)


LENS, PAST = [5, 2, 1], [4, 0, 9]  # right-padded rows, one fresh: each row's state moves at its own tokens only
# a decode step, one chunk with padding, and a prompt of chunks whose last one is padded (rows ending in different
# chunks: one at a boundary)
CHUNKED_LENS = pytest.mark.parametrize("lens", [[1, 1, 1], LENS, [150, 64, 3]], ids=["decode", "one", "three"])


@CHUNKED_LENS
def test_delta_step_onnx_loop_matches_the_reference(lens):
    q, k, v, g, beta = _delta_inputs(3, max(lens), seed=2)
    inputs = (q, k, v, g, beta, torch.randn(3, HV, DK, DV), torch.tensor(PAST), torch.tensor(lens))
    _onnx_loop_matches(_Step(GATED_DELTA_STEP.op, use_qk_l2norm=True), inputs, dict.fromkeys(range(5), 1), lens)


@CHUNKED_LENS
def test_ssd_step_onnx_loop_matches_the_reference(lens):
    gen, tokens = torch.Generator().manual_seed(5), max(lens)
    x, dt = torch.randn(3, tokens, 4, 6, generator=gen), torch.randn(3, tokens, 4, generator=gen)
    B, C = (torch.randn(3, tokens, 2, 3, generator=gen) for _ in range(2))
    A, D, dt_bias = -torch.rand(4, generator=gen), torch.randn(4, generator=gen), torch.randn(4, generator=gen)
    state = torch.randn(3, 4, 6, 3, generator=gen)
    inputs = (x, dt, A, B, C, D, dt_bias, state, torch.tensor(PAST), torch.tensor(lens))
    step = _Step(SSD_STEP.op, softplus=True, dt_min=0.0, dt_max=float("inf"))
    _onnx_loop_matches(step, inputs, {0: 1, 1: 1, 3: 1, 4: 1}, lens)


def test_selective_step_onnx_loop_matches_the_reference():
    gen = torch.Generator().manual_seed(6)
    x, dt, z = (torch.randn(3, 6, 5, generator=gen) for _ in range(3))
    B, C = (torch.randn(3, 4, 5, generator=gen) for _ in range(2))
    A, D, dt_bias = -torch.rand(6, 4, generator=gen), torch.randn(6, generator=gen), torch.randn(6, generator=gen)
    inputs = (
        x,
        dt,
        A,
        B,
        C,
        D,
        z,
        dt_bias,
        torch.randn(3, 6, 4, generator=gen),
        torch.tensor(PAST),
        torch.tensor(LENS),
    )
    _onnx_loop_matches(_Step(SELECTIVE_STEP.op, softplus=True), inputs, {0: 2, 1: 2, 3: 2, 4: 2, 6: 2}, LENS)
