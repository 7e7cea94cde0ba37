"""The moe_experts op: its gate found from the experts module, its ONNX Runtime and TVM lowerings against the
reference (gpt-oss's clamped SwiGLU with biases too), and its cost counting only the chosen experts' weights.
qmoe_experts (quantized experts): ONNX Runtime's QMoE where its CPU kernel computes the variant, the float MoE
fallback where not, and the TVM kernel, each against the reference."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
import onnxruntime
import pytest
import torch
import transformers
import tvm

from llmlower.backends.onnx.lowerings import translations
from llmlower.backends.tvm.compile import compile_module, tvm_target
from llmlower.backends.tvm.int8_dot import int8_dot_product
from llmlower.backends.tvm.lowerings import convert_map
from llmlower.backends.tvm.relax_import import StepImporter
from llmlower.errors import CaptureError
from llmlower.frontend.experts_capture import gate_parameters, prepare_experts
from llmlower.ir.moe import MOE_EXPERTS, moe_experts_reference
from llmlower.ir.qmoe import QMOE_EXPERTS, qmoe_experts_reference
from llmlower.ir.quant import QuantScheme, quantize
from llmlower.roofline.cost import OP_ARGUMENTS

EXPERTS, HIDDEN, INTERMEDIATE, TOKENS, TOP_K = 6, 16, 8, 5, 2
GPT_OSS_GATE = (1.702, 1.0, 7.0)


def _case(biases: bool, seed: int = 0, tokens: int = TOKENS) -> tuple:
    """Random inputs of moe_experts with values large enough to reach gpt-oss's clamp."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=gen) * 2
    ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(tokens)])
    weights = torch.rand(tokens, TOP_K, generator=gen) + 0.1
    w_up = torch.randn(EXPERTS, 2 * INTERMEDIATE, HIDDEN, generator=gen)
    w_down = torch.randn(EXPERTS, HIDDEN, INTERMEDIATE, generator=gen) * 0.3
    b_up = torch.randn(EXPERTS, 2 * INTERMEDIATE, generator=gen) if biases else None
    b_down = torch.randn(EXPERTS, HIDDEN, generator=gen) if biases else None
    return x, ids, weights, w_up, b_up, w_down, b_down


class MoeLayer(torch.nn.Module):
    def __init__(self, gate: tuple[float, float, float]) -> None:
        super().__init__()
        self.gate = gate

    def forward(self, x, ids, weights, w_up, b_up, w_down, b_down):
        return MOE_EXPERTS.op(x, ids, weights, w_up, b_up, w_down, b_down, *self.gate)


def _per_expert(case, gate) -> torch.Tensor:
    """The experts one token and expert at a time, as a loop would (the reference computes all at once)."""
    x, ids, weights, w_up, b_up, w_down, b_down = case
    out = torch.zeros_like(x)
    for t in range(TOKENS):
        for j in range(TOP_K):
            e = int(ids[t, j])
            up = w_up[e] @ x[t] + (b_up[e] if b_up is not None else 0)
            g, u = up[0::2], up[1::2]
            if gate[2]:
                g, u = g.clamp(max=gate[2]), u.clamp(-gate[2], gate[2])
            down = w_down[e] @ (g * torch.sigmoid(gate[0] * g) * (u + gate[1]))
            out[t] += weights[t, j] * (down + (b_down[e] if b_down is not None else 0))
    return out


GATES = [((1.0, 0.0, 0.0), False), (GPT_OSS_GATE, True)]


@pytest.mark.parametrize(("gate", "biases"), GATES)
def test_the_reference_is_the_per_expert_loop(gate, biases):
    case = _case(biases)
    torch.testing.assert_close(moe_experts_reference(*case, *gate), _per_expert(case, gate), rtol=1e-4, atol=1e-4)


INPUTS = 3  # x, expert_ids, expert_weights: the rest are the layer's weights


def _onnx_model(op, case: tuple, constants: tuple, accuracy_level: int = 4) -> onnx.ModelProto:
    """op(*case, *constants) exported by torch.onnx with the project's translations: x, ids and weights are the
    model's inputs, the experts' tensors its initializers (as in a compiled model: ONNX Runtime prepacks those)."""

    class Layer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            for i, tensor in enumerate(case[INPUTS:]):
                if tensor is not None:
                    self.register_buffer(f"w{i}", tensor)

        def forward(self, *inputs):
            tensors = [getattr(self, f"w{i}") if t is not None else None for i, t in enumerate(case[INPUTS:])]
            return op(*inputs, *tensors, *constants)

    exported = torch.export.export(Layer(), case[:INPUTS])
    table = translations(accuracy_level)
    return torch.onnx.export(exported, custom_translation_table=table, dynamo=True).model_proto


def _run_onnx(model: onnx.ModelProto, case: tuple) -> np.ndarray:
    session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (got,) = session.run(None, {i.name: t.numpy() for i, t in zip(session.get_inputs(), case, strict=False)})
    return got


@pytest.mark.parametrize(("gate", "biases"), GATES)
def test_onnx_runtime_moe_matches_the_reference(gate, biases):
    case = _case(biases)
    got = _run_onnx(_onnx_model(MOE_EXPERTS.op, case, gate), case)
    np.testing.assert_allclose(got, moe_experts_reference(*case, *gate).numpy(), rtol=1e-4, atol=1e-4)


TOKEN_COUNTS = (1, 5, 33)  # a decode step, a few tokens, a prompt


@tvm.instrument.pass_instrument
class Scheduled:
    """The PrimFuncs DLight's rules scheduled."""

    def __init__(self) -> None:
        self.names: set[str] = set()

    def run_after_pass(self, module: tvm.IRModule, info: tvm.transform.PassInfo) -> None:
        if info.name == "ApplyDefaultSchedule":
            self.names = {
                gv.name_hint
                for gv, f in module.functions.items()
                if isinstance(f, tvm.tirx.PrimFunc) and "tirx.is_scheduled" in f.attrs
            }


def _tvm_kernel(
    op, case: tuple, constants: tuple, accuracy_level: int = 0, int8_matmuls: int = 0
) -> Callable[[tuple], np.ndarray]:
    """op(*case, *constants) for any number of tokens, imported by the TVM backend's converters (at accuracy_level)
    and compiled by its CPU pipeline, as a function of a case; `int8_matmuls` of the experts' two matmuls must have
    taken the int8 kernel, the others the CPU schedule."""
    present = [t is not None for t in case]

    class Layer(torch.nn.Module):
        def forward(self, *given):
            tensors = iter(given)
            return op(*[next(tensors) if p else None for p in present], *constants)

    given = tuple(t for t in case if t is not None)
    tokens = torch.export.Dim("tokens", min=1, max=1024)
    shapes = tuple({0: tokens} if i < INPUTS else None for i in range(len(given)))
    exported = torch.export.export(Layer(), given, dynamic_shapes=(shapes,)).run_decompositions()
    target = tvm_target("cpu")
    module = StepImporter(target, accuracy_level).from_exported_program(exported, False, True, False, convert_map())
    int8 = [gv.name_hint for gv in module.functions if gv.name_hint.startswith("qlinear_experts")]
    assert len(int8) == int8_matmuls
    scheduled = Scheduled()
    with tvm.transform.PassContext(instruments=[scheduled]):
        vm = tvm.relax.VirtualMachine(compile_module(module, target), tvm.cpu())
    assert len({"moe_up", "moe_down"} & scheduled.names) == 2 - int8_matmuls  # kernels of their own, scheduled

    def run(case: tuple) -> np.ndarray:
        return vm["main"](*[tvm.runtime.tensor(t.numpy()) for t in case if t is not None]).numpy()

    return run


@pytest.mark.parametrize(("gate", "biases"), GATES)
def test_the_tvm_kernel_matches_the_reference(gate, biases):
    kernel = _tvm_kernel(MOE_EXPERTS.op, _case(biases), gate)
    for tokens in TOKEN_COUNTS:
        case = _case(biases, seed=tokens, tokens=tokens)
        np.testing.assert_allclose(kernel(case), moe_experts_reference(*case, *gate).numpy(), rtol=1e-4, atol=1e-4)


def _gpt_oss_experts() -> torch.nn.Module:
    config = transformers.GptOssConfig(
        hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K
    )
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    config._experts_implementation = "eager"
    return GptOssExperts(config)


def test_the_gate_of_each_family_is_found_by_probing(tiny_checkpoints):
    from llmlower.frontend import load

    loaded = load(tiny_checkpoints["mixtral"])
    experts = [m for m in loaded.module.modules() if hasattr(m, "llmlower_gate")]
    assert len(experts) == 2 and all(m.llmlower_gate == (1.0, 0.0, 0.0) for m in experts)
    assert gate_parameters(_gpt_oss_experts()) == pytest.approx(GPT_OSS_GATE)


def test_an_unknown_gate_is_refused_naming_the_module():
    experts = _gpt_oss_experts()
    experts._apply_gate = lambda gate_up: torch.nn.functional.gelu(gate_up[..., ::2]) * gate_up[..., 1::2]
    with pytest.raises(CaptureError, match="GptOssExperts: its experts' gate function is not a"):
        prepare_experts(torch.nn.Sequential(experts))


def test_a_decode_step_costs_the_chosen_experts_weights_only():
    one_expert = 4 * (3 * HIDDEN * INTERMEDIATE)
    decode = MOE_EXPERTS.cost(1, TOP_K, EXPERTS, HIDDEN, INTERMEDIATE, one_expert, 4)
    prefill = MOE_EXPERTS.cost(512, TOP_K, EXPERTS, HIDDEN, INTERMEDIATE, one_expert, 4)
    assert decode.weight_bytes == TOP_K * one_expert
    assert prefill.weight_bytes == EXPERTS * one_expert


Q_HIDDEN, Q_INTERMEDIATE = 64, 32  # QMoE needs both sizes divisible by the block size
Q4_ZP4 = QuantScheme(4, 32, symmetric=False, packed_zeros=True)
# name -> (gate/up scheme, down scheme, whether ONNX Runtime's QMoE computes it: else the float MoE fallback)
QUANTIZED = {
    "q4g32-sym": (QuantScheme(4, 32), QuantScheme(4, 32), True),
    "q4g16-zp4": (QuantScheme(4, 16, symmetric=False, packed_zeros=True),) * 2 + (True,),
    "q8": (QuantScheme(8, 32), QuantScheme(8, 32), True),
    "q4g32 float zeros": (QuantScheme(4, 32, symmetric=False), QuantScheme(4, 32, symmetric=False), False),
    "q4g32-zp4 gate/up, q8 down": (Q4_ZP4, QuantScheme(8, 32), True),  # q4mix's: run as 8 bits
    "q4g32-sym gate/up, q8 down": (QuantScheme(4, 32), QuantScheme(8, 32), True),
    "q4g64-zp4 (64 > intermediate)": (QuantScheme(4, 64, symmetric=False, packed_zeros=True),) * 2 + (False,),
}


def _quantized_case(
    up: QuantScheme, down: QuantScheme, biases: bool, tokens: int = TOKENS, seed: int = 3
) -> tuple[tuple, tuple[int, int]]:
    """qmoe_experts' tensors (x, ids, weights, up q/scales/zeros/bias, down q/scales/zeros/bias) and bits."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, Q_HIDDEN, generator=gen)
    ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(tokens)])
    weights = torch.rand(tokens, TOP_K, generator=gen) + 0.1
    w_up = quantize(torch.randn(EXPERTS, 2 * Q_INTERMEDIATE, Q_HIDDEN, generator=gen) * 0.3, up)
    w_down = quantize(torch.randn(EXPERTS, Q_HIDDEN, Q_INTERMEDIATE, generator=gen) * 0.3, down)
    b_up = torch.randn(EXPERTS, 2 * Q_INTERMEDIATE, generator=gen) if biases else None
    b_down = torch.randn(EXPERTS, Q_HIDDEN, generator=gen) if biases else None
    tensors = (x, ids, weights, w_up.qweight, w_up.scales, w_up.zeros, b_up)
    return tensors + (w_down.qweight, w_down.scales, w_down.zeros, b_down), (up.bits, down.bits)


def _qmoe(bits: tuple[int, int]):
    """qmoe_experts over the tensors of _quantized_case, its bits fixed."""

    def op(x, ids, weights, up_q, up_s, up_z, b_up, down_q, down_s, down_z, b_down, *gate):
        up, down = (up_q, up_s, up_z, b_up, bits[0]), (down_q, down_s, down_z, b_down, bits[1])
        return QMOE_EXPERTS.op(x, ids, weights, *up, *down, *gate)

    return op


def _qmoe_reference(case: tuple, bits: tuple[int, int], gate) -> np.ndarray:
    return qmoe_experts_reference(*case[:7], bits[0], *case[7:], bits[1], *gate).numpy()


def _experts_kernels(model: onnx.ModelProto) -> list[str]:
    return [node.op_type for node in model.graph.node if node.op_type in ("MoE", "QMoE")]


def _relative_error(got: np.ndarray, expected: np.ndarray) -> float:
    return float(np.abs(got - expected).max() / np.abs(expected).max())


@pytest.mark.parametrize("accuracy_level", [0, 4])
@pytest.mark.parametrize("name", QUANTIZED)
def test_onnx_runtime_qmoe_or_its_fallback_matches_the_reference(name, accuracy_level):
    """QMoE where its CPU kernel computes the variant: exact with 4 bits at accuracy_level 0, int8 activations
    (~1-2% error) at level 4 and with 8 bits at any level (mixed bits run as 8), so 8 bits at level 0 falls back to
    stay exact; float zero points and a block size that does not divide the sizes fall back to the float MoE
    (exact)."""
    up, down, native = QUANTIZED[name]
    case, bits = _quantized_case(up, down, biases=False)
    model = _onnx_model(_qmoe(bits), case, (1.0, 0.0, 0.0), accuracy_level)
    kernel = "QMoE" if native and not (8 in bits and accuracy_level == 0) else "MoE"
    assert _experts_kernels(model) == [kernel]
    error = _relative_error(_run_onnx(model, case), _qmoe_reference(case, bits, (1.0, 0.0, 0.0)))
    exact = kernel == "MoE" or accuracy_level == 0
    assert error < 1e-5 if exact else 1e-3 < error < 5e-2, error


def test_onnx_runtime_qmoe_takes_the_clamped_swiglu_and_biases():
    case, bits = _quantized_case(Q4_ZP4, Q4_ZP4, biases=True)
    model = _onnx_model(_qmoe(bits), case, GPT_OSS_GATE, accuracy_level=0)
    assert _experts_kernels(model) == ["QMoE"]
    assert _relative_error(_run_onnx(model, case), _qmoe_reference(case, bits, GPT_OSS_GATE)) < 1e-5


@pytest.mark.parametrize("name", QUANTIZED)
def test_the_tvm_kernel_dequantizes_the_chosen_experts_as_the_reference(name):
    up, down, _ = QUANTIZED[name]
    case, bits = _quantized_case(up, down, biases=True)
    kernel = _tvm_kernel(_qmoe(bits), case, GPT_OSS_GATE)
    for tokens in TOKEN_COUNTS:
        case, _ = _quantized_case(up, down, biases=True, tokens=tokens, seed=tokens)
        assert _relative_error(kernel(case), _qmoe_reference(case, bits, GPT_OSS_GATE)) < 1e-5


def _rounds_x(scheme: QuantScheme, in_features: int) -> bool:
    """Whether the int8 kernel takes a matmul in this scheme: whole groups of whole 16-byte vectors."""
    return scheme.group * scheme.bits // 8 % 16 == 0 and in_features % scheme.group == 0


@pytest.mark.skipif(int8_dot_product(tvm_target("cpu")) is None, reason="no int8 dot product on this CPU")
@pytest.mark.parametrize("name", QUANTIZED)
def test_the_tvm_int8_kernel_takes_each_token_and_chosen_expert(name):
    """At accuracy_level 4 the experts' matmuls in groups the int8 path rounds take its kernel: each (token, expert)
    pair against its expert's weight rows, off the reference by the rounding of x only (1-2%); a scheme it does not
    round keeps the exact dequantizing kernel."""
    up, down, _ = QUANTIZED[name]
    int8 = _rounds_x(up, Q_HIDDEN) + _rounds_x(down, Q_INTERMEDIATE)
    case, bits = _quantized_case(up, down, biases=True)
    kernel = _tvm_kernel(_qmoe(bits), case, GPT_OSS_GATE, accuracy_level=4, int8_matmuls=int8)
    for tokens in TOKEN_COUNTS:
        case, _ = _quantized_case(up, down, biases=True, tokens=tokens, seed=tokens)
        error = _relative_error(kernel(case), _qmoe_reference(case, bits, GPT_OSS_GATE))
        assert 1e-4 < error < 5e-2 if int8 else error < 1e-5, error


def test_a_decode_step_costs_the_chosen_experts_packed_bytes():
    """One token, top_k experts: their packed weights, scales and zero points, not the float weights."""
    case, bits = _quantized_case(Q4_ZP4, QuantScheme(8, 32), biases=False)
    args = [*case[:7], bits[0], *case[7:], bits[1]]
    args[0], args[1], args[2] = case[0][:1], case[1][:1], case[2][:1]
    cost = QMOE_EXPERTS.cost(**OP_ARGUMENTS["qmoe_experts"](args))
    per_expert = sum(t[0].numel() * t[0].element_size() for t in case[3:] if t is not None)
    packed = 2 * Q_INTERMEDIATE * Q_HIDDEN // 2 + Q_HIDDEN * Q_INTERMEDIATE  # int4 gate/up, int8 down
    scales = 4 * (2 * Q_INTERMEDIATE * Q_HIDDEN // 32 + Q_HIDDEN * Q_INTERMEDIATE // 32)  # float32, groups of 32
    assert per_expert == packed + scales + 2 * Q_INTERMEDIATE  # + one byte of zero points per gate/up row
    assert cost.weight_bytes == TOP_K * per_expert
