"""The moe_experts op: its gate found from the experts module, its ONNX Runtime and TVM lowerings against the
reference (gpt-oss's clamped SwiGLU with biases too), and its cost counting only the chosen experts' weights."""

from __future__ import annotations

import numpy as np
import onnxruntime
import pytest
import torch
import transformers
import tvm
from tvm import te

from llmlower.backends.onnx.lowerings import translations
from llmlower.backends.tvm.lowerings import moe_te
from llmlower.errors import CaptureError
from llmlower.frontend.experts_capture import gate_parameters, prepare_experts
from llmlower.ir.moe import MOE_EXPERTS, moe_experts_reference

EXPERTS, HIDDEN, INTERMEDIATE, TOKENS, TOP_K = 6, 16, 8, 5, 2
GPT_OSS_GATE = (1.702, 1.0, 7.0)


def _case(biases: bool, seed: int = 0) -> tuple:
    """Random inputs of moe_experts with values large enough to reach gpt-oss's clamp."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(TOKENS, HIDDEN, generator=gen) * 2
    ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(TOKENS)])
    weights = torch.rand(TOKENS, TOP_K, generator=gen) + 0.1
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


@pytest.mark.parametrize(("gate", "biases"), GATES)
def test_onnx_runtime_moe_matches_the_reference(gate, biases):
    case = _case(biases)
    present = [t for t in case if t is not None]

    class Present(torch.nn.Module):  # the exporter takes tensors only: the absent biases are fixed None
        def forward(self, *tensors):
            values = iter(tensors)
            return MoeLayer(gate)(*(next(values) if t is not None else None for t in case))

    exported = torch.export.export(Present(), tuple(present))
    model = torch.onnx.export(exported, custom_translation_table=translations(), dynamo=True).model_proto
    session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {i.name: t.numpy() for i, t in zip(session.get_inputs(), present, strict=True)}
    (got,) = session.run(None, feeds)
    np.testing.assert_allclose(got, moe_experts_reference(*case, *gate).numpy(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("gate", "biases"), GATES)
def test_the_tvm_kernel_matches_the_reference(gate, biases):
    case = _case(biases)
    x, ids, weights, w_up, b_up, w_down, b_down = case
    placeholders = {
        name: te.placeholder(tuple(t.shape), "int64" if t.dtype == torch.int64 else "float32", name)
        for name, t in zip(["x", "ids", "weights", "w_up", "b_up", "w_down", "b_down"], case, strict=True)
        if t is not None
    }
    p = placeholders
    out = moe_te(p["x"], p["ids"], p["weights"], p["w_up"], p.get("b_up"), p["w_down"], p.get("b_down"), *gate)
    function = tvm.compile(te.create_prim_func([*p.values(), out]), target="llvm")
    device = tvm.cpu()
    arguments = [tvm.runtime.tensor(t.numpy(), device) for t in case if t is not None]
    result = tvm.runtime.tensor(np.zeros((TOKENS, HIDDEN), np.float32), device)
    function(*arguments, result)
    np.testing.assert_allclose(result.numpy(), moe_experts_reference(*case, *gate).numpy(), rtol=1e-4, atol=1e-4)


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
