"""Weight quantization: formats against a straightforward reference quantizer and against ONNX Runtime's own
MatMulNBits kernel; the quantize pass's options, tied weights and sizes."""

from __future__ import annotations

import copy

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from llmlower.errors import PassError
from llmlower.frontend import capture, load
from llmlower.ir import MOE_EXPERTS, QEMBEDDING, QLINEAR, QMOE_EXPERTS
from llmlower.ir.program import fetch_attr
from llmlower.ir.quant import QuantScheme, dequantize, quantize
from llmlower.passes import DEFAULT_PIPELINE, build_pipeline, run_pipeline

SCHEMES = [
    QuantScheme(8, 32),
    QuantScheme(8, 128),
    QuantScheme(8, 0),  # per channel: one group per row
    QuantScheme(4, 32, symmetric=False),
    QuantScheme(4, 64, symmetric=False, packed_zeros=True),
    QuantScheme(4, 64, symmetric=True),
    QuantScheme(4, 128, symmetric=True),
]


def reference_dequantized(weight: np.ndarray, scheme: QuantScheme) -> np.ndarray:
    """Quantize and dequantize one group at a time, as the format's docstring spells it (float32 math; the
    input dim zero-padded to whole groups)."""
    rows, cols = weight.shape
    group = scheme.group or cols
    weight = np.pad(weight.astype(np.float32), ((0, 0), (0, -cols % group)))
    out = np.zeros_like(weight)
    for r in range(rows):
        for start in range(0, weight.shape[1], group):
            w = weight[r, start : start + group]
            if scheme.bits == 8:
                scale = np.float32(np.abs(w).max() / np.float32(127))
                q = np.clip(np.round(w / scale), -127, 127)
                out[r, start : start + group] = q * scale
            elif scheme.symmetric:
                scale = np.float32(w[np.argmax(np.abs(w))] / np.float32(-8))
                q = np.clip(np.round(w / scale), -8, 7) + 8
                out[r, start : start + group] = (q - 8) * scale
            elif not scheme.packed_zeros:
                scale = np.float32((w.max() - w.min()) / np.float32(15))
                q = np.clip(np.round((w - w.min()) / scale), 0, 15)
                zero = np.float32(-w.min() / scale)
                out[r, start : start + group] = (q - zero) * scale
            else:
                lo, hi = min(w.min(), np.float32(0)), max(w.max(), np.float32(0))
                scale = np.float32((hi - lo) / np.float32(15))
                zero = np.clip(np.round(-lo / scale), 0, 15)
                q = np.clip(np.round(w / scale) + zero, 0, 15)
                out[r, start : start + group] = (q - zero) * scale
    return out[:, :cols]


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.name)
@pytest.mark.parametrize("cols", [256, 200])  # 200: the last group is partial (zero-padded)
def test_dequantized_weights_match_reference_bit_for_bit(scheme, cols):
    weight = torch.randn(24, cols, generator=torch.Generator().manual_seed(cols))
    packed = quantize(weight, scheme)
    ours = dequantize(packed.qweight, packed.scales, packed.zeros, scheme.bits, packed.in_features)
    assert ours.shape == weight.shape
    np.testing.assert_array_equal(ours.numpy(), reference_dequantized(weight.numpy(), scheme))


@pytest.mark.parametrize("scheme", [s for s in SCHEMES if s.group], ids=lambda s: s.name)
def test_layout_is_what_onnxruntime_matmulnbits_reads(scheme):
    rows, k, n = 5, 320, 48  # 320 / 128 = 2.5: a padded last block and an odd number of zero points
    gen = torch.Generator().manual_seed(1)
    weight, x = torch.randn(n, k, generator=gen), torch.randn(rows, k, generator=gen)
    packed = quantize(weight, scheme)
    blocks = packed.qweight.shape[1]
    assert packed.qweight.shape == (n, blocks, scheme.group * scheme.bits // 8) and packed.qweight.dtype == torch.uint8
    assert packed.scales.shape == (n, blocks)
    inputs = ["A", "B", "scales"] + ([] if packed.zeros is None else ["zero_points"])
    initializers = [
        numpy_helper.from_array(packed.qweight.numpy(), "B"),
        numpy_helper.from_array(packed.scales.numpy().reshape(-1), "scales"),
    ]
    if packed.zeros is not None:
        expected_shape = (n, (blocks + 1) // 2) if scheme.packed_zeros else (n, blocks)
        assert packed.zeros.shape == expected_shape
        assert packed.zeros.dtype == (torch.uint8 if scheme.packed_zeros else packed.scales.dtype)
        initializers.append(numpy_helper.from_array(packed.zeros.numpy().reshape(-1), "zero_points"))
    node = helper.make_node(
        "MatMulNBits", inputs, ["Y"], domain="com.microsoft", K=k, N=n, bits=scheme.bits, block_size=scheme.group
    )
    graph = helper.make_graph(
        [node],
        "matmulnbits",
        [helper.make_tensor_value_info("A", TensorProto.FLOAT, [rows, k])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [rows, n])],
        initializers,
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)], ir_version=10
    )
    onnx.checker.check_model(model)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    [actual] = session.run(None, {"A": x.numpy()})
    expected = QLINEAR.op(x, packed.qweight, packed.scales, packed.zeros, None, scheme.bits, k)
    np.testing.assert_allclose(actual, expected.numpy(), rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def gpt2_program(tiny_checkpoints):
    """GPT-2: Conv1D projections (addmm) and an LM head tied to the token embedding."""
    return run_pipeline(capture(load(tiny_checkpoints["gpt2"])), DEFAULT_PIPELINE)


def _targets(program, op):
    return [n for n in program.graph_module.graph.nodes if n.target is op]


def test_tied_embedding_and_lm_head_share_one_quantized_table(gpt2_program):
    options = {"bits": 4, "group": 32, "quantize_embedding": True}
    program = run_pipeline(copy.deepcopy(gpt2_program), [("quantize_weights", options)], verify=True)
    stats = program.history[-1].stats
    assert stats["linears_quantized"] == 2 * 4 + 1 and stats["embeddings_quantized"] == 2  # tokens and positions
    gm = program.graph_module
    head = _targets(program, QLINEAR.overload)[-1]
    token_lookup = _targets(program, QEMBEDDING.overload)[0]
    assert fetch_attr(gm, head.args[1].target) is fetch_attr(gm, token_lookup.args[1].target)  # one table
    assert not any(p.dtype.is_floating_point and p.dim() == 2 for p in gm.parameters())  # no fp32 copy left


def test_keep_options_leave_layers_in_full_precision(gpt2_program):
    options = {"bits": 8, "keep_lm_head": True, "keep": ["h.0."]}
    program = run_pipeline(copy.deepcopy(gpt2_program), [("quantize_weights", options)], verify=True)
    stats = program.history[-1].stats
    assert (stats["linears_quantized"], stats["linears_kept"]) == (4, 5)  # layer 1's four; layer 0's four + head
    assert program.history[-1].max_error < 0.05
    targets = [n.args[1].target for n in _targets(program, QLINEAR.overload)]
    assert all(".h.1." in t for t in targets)


def test_overrides_give_matching_weights_their_own_scheme(gpt2_program):
    """The first override whose name is in a weight's name sets its scheme (here the MLP's c_fc to int4 with
    packed zero points); the rest take the default (int8), the LM head its own; a bad override is named."""
    options = {"bits": 8, "overrides": [["mlp.c_fc", {"bits": 4, "group": 32, "packed_zeros": True}]]}
    program = run_pipeline(copy.deepcopy(gpt2_program), [("quantize_weights", options)], verify=True)
    assert program.history[-1].stats["overrides"] == {"mlp.c_fc": "q4g32-zp4"}
    gm = program.graph_module
    for node in _targets(program, QLINEAR.overload):
        int4 = "mlp.c_fc" in node.args[1].target
        assert node.args[5] == (4 if int4 else 8), node.args[1].target
        assert (node.args[3] is not None and fetch_attr(gm, node.args[3].target).dtype == torch.uint8) == int4
    bad = {"bits": 8, "overrides": [["c_fc", {"bits": 3}]]}
    with pytest.raises(PassError, match="quantize_weights: bits must be 4 or 8"):
        run_pipeline(copy.deepcopy(gpt2_program), [("quantize_weights", bad)])


def test_q4mix_is_int4_where_it_is_cheap_and_int8_elsewhere(gpt2_program):
    """int4 for o/gate/up, int8 in groups of 32 elsewhere and per channel for the LM head (an int4 head, when
    asked for, takes the weights' group)."""
    options = build_pipeline(quant="q4mix")[-1][1]
    assert options["bits"] == 8 and options["group"] == 32
    assert [name for name, _ in options["overrides"]] == ["o_proj", "gate_proj", "up_proj"]
    assert all(o == {"bits": 4, "group": 32, "symmetric": False, "packed_zeros": True} for _, o in options["overrides"])
    program = run_pipeline(copy.deepcopy(gpt2_program), build_pipeline(quant="q4mix")[-1:])
    assert program.history[-1].stats["lm_head"] == "q8c"
    program = run_pipeline(copy.deepcopy(gpt2_program), build_pipeline(quant="q4mix", lm_head_bits=4)[-1:])
    assert program.history[-1].stats["lm_head"] == "q4g32"


def test_float_zero_points_reproduce_a_q4_1_grid_exactly():
    """Weights already on llama.cpp's Q4_1 grid (scale d, offset m per 32) survive requantization exactly with
    float zero points; 4-bit integer zero points shift each group."""
    gen = torch.Generator().manual_seed(2)
    d, m = torch.rand(16, 4, 1, generator=gen) * 0.1, -torch.rand(16, 4, 1, generator=gen)
    q = torch.randint(0, 16, (16, 4, 32), generator=gen).float()
    q[..., 0], q[..., 1] = 0, 15  # each group spans its whole grid
    weight = (q * d + m).reshape(16, 128)
    for packed_zeros, exact in ((False, True), (True, False)):
        packed = quantize(weight, QuantScheme(4, 32, symmetric=False, packed_zeros=packed_zeros))
        error = (dequantize(packed.qweight, packed.scales, packed.zeros, 4, 128) - weight).abs().max()
        assert (error < 1e-6) == exact, (packed_zeros, error)


def test_int4_verification_bounds_and_sizes(gpt2_program):
    program = run_pipeline(copy.deepcopy(gpt2_program), [("quantize_weights", {"bits": 4, "group": 32})], verify=True)
    stats = program.history[-1].stats
    assert stats["scheme"] == "q4g32"
    assert stats["quantized_weight_bytes_after"] <= 0.3 * stats["quantized_weight_bytes_before"]
    assert stats["parameter_bytes"] < stats["parameter_bytes_before"]


def test_bad_group_size_is_named(gpt2_program):
    with pytest.raises(PassError, match="group size"):
        run_pipeline(copy.deepcopy(gpt2_program), [("quantize_weights", {"bits": 4, "group": 48})])


def test_moe_experts_are_quantized_under_their_transformers_names(tiny_checkpoints):
    """Each experts module's gate/up and down are named <module>.gate_up_proj / .down_proj for overrides and keep:
    q4mix gives gate/up its int4 (4-bit zero points, per expert) and down int8; keeping either keeps both."""
    captured = capture(load(tiny_checkpoints["mixtral"]))
    program = run_pipeline(copy.deepcopy(captured), build_pipeline(quant="q4mix"))
    assert program.history[-1].stats["experts_quantized"] == 2
    for node in _targets(program, QMOE_EXPERTS.overload):
        up_qweight, up_zeros, down_qweight = (fetch_attr(program.graph_module, node.args[i].target) for i in (3, 5, 8))
        assert (node.args[7], node.args[12]) == (4, 8) and node.args[10] is None
        assert up_qweight.shape == (4, 2 * 128, 64 // 32, 16) and up_zeros.dtype == torch.uint8
        assert down_qweight.shape == (4, 64, 128 // 32, 32)
    kept = run_pipeline(copy.deepcopy(captured), build_pipeline(quant="q8", keep=["experts.down_proj"]))
    assert kept.history[-1].stats["experts_kept"] == 2
    assert not _targets(kept, QMOE_EXPERTS.overload) and len(_targets(kept, MOE_EXPERTS.overload)) == 2


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.name)
def test_float16_scales_keep_16_bits_and_the_nearest_codes_for_them(scheme):
    """scale_dtype float16: scales (and float zero points) stored in 16 bits, 2 bytes a group less each; the codes
    are rounded against each scale as stored, so the error stays within half a step (plus a float zero point's own
    float16 rounding), or a step where 4-bit grids clamp: symmetric (-8 s .. 7 s) and with 4-bit zero points (the
    rounded zero point shifts the group by up to half a step)."""
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(64, 256, generator=gen) * 0.05
    narrow = QuantScheme(scheme.bits, scheme.group, scheme.symmetric, scheme.packed_zeros, "float16")
    assert narrow.name == f"{scheme.name}-f16"
    wide, packed = quantize(weight, scheme), quantize(weight, narrow)
    assert packed.scales.dtype == torch.float16 and packed.qweight.shape == wide.qweight.shape
    float_zeros = packed.zeros is not None and packed.zeros.dtype != torch.uint8
    assert not float_zeros or packed.zeros.dtype == torch.float16
    assert wide.nbytes() - packed.nbytes() == 2 * packed.scales.numel() * (1 + float_zeros)
    restored = dequantize(packed.qweight, packed.scales, packed.zeros, scheme.bits, 256)
    step = packed.scales.float().abs().repeat_interleave(scheme.group or 256, dim=1)
    clamped = scheme.bits == 4 and (scheme.symmetric or scheme.packed_zeros)
    bound = 1 if clamped else 0.5 + (15 * 2.0**-11 if float_zeros else 1e-6)
    assert ((restored - weight).abs() <= step * bound).all()


def test_float16_scales_reach_every_linear_but_not_the_embedding(gpt2_program):
    """The pipeline option reaches the weights, the LM head and overrides; a table tied to the head keeps its own
    scales in the model's dtype (qembedding returns rows in its scales' dtype), so it is stored apart from the head
    under another name; unknown dtypes and the option without --quant are refused by name."""
    pipeline = build_pipeline(quant="q4mix", lm_head_bits=4, quantize_embedding=True, scale_dtype="float16")
    program = run_pipeline(copy.deepcopy(gpt2_program), pipeline[-1:], verify=True)
    assert program.history[-1].stats["lm_head"] == "q4g32-f16"
    gm = program.graph_module
    assert all(fetch_attr(gm, n.args[2].target).dtype == torch.float16 for n in _targets(program, QLINEAR.overload))
    for lookup in _targets(program, QEMBEDDING.overload):
        assert fetch_attr(gm, lookup.args[2].target).dtype == torch.float32
        assert lookup.meta["val"].dtype == torch.float32
    with pytest.raises(PassError, match="quantize_weights: scale_dtype must be None or 'float16', got 'bfloat16'"):
        run_pipeline(copy.deepcopy(gpt2_program), [("quantize_weights", {"bits": 4, "scale_dtype": "bfloat16"})])
    with pytest.raises(PassError, match="--scale-dtype need --quant"):
        build_pipeline(scale_dtype="float16")
