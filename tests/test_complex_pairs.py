"""canonicalize's complex values as real pairs: a complex rotary (Llama 4's spelling, with a conjugate, a complex
sum and a complex weight besides) gives the same numbers in real ops only, and an op with no pair form is refused
by name."""

from __future__ import annotations

import pytest
import torch

from llmlower.errors import PassError
from llmlower.ir.program import flat_graph_module
from llmlower.passes.complex_pairs import lower_complex
from llmlower.passes.graph_utils import finish


class ComplexRotary(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("phase", torch.polar(torch.ones(4), torch.linspace(0.1, 0.9, 4)))  # a complex weight
        self.inv_freq = torch.nn.Buffer(1.0 / 10000 ** (torch.arange(0, 8, 2).float() / 8))

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        angles = positions[..., None].float() * self.inv_freq  # [batch, tokens, 4]
        rotation = torch.polar(torch.ones_like(angles), angles) * 0.5
        pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))  # [batch, tokens, heads, 4]
        rotated = pairs * rotation[:, :, None, :]
        mixed = rotated.conj() + rotated * self.phase - pairs.transpose(1, 2).transpose(1, 2)
        return torch.view_as_real(mixed).flatten(3) + torch.view_as_real(rotated.unsqueeze(-1)).sum(-2).flatten(3)


def _graph(module: torch.nn.Module, *args: torch.Tensor) -> torch.fx.GraphModule:
    return flat_graph_module(torch.export.export(module, args))


def test_complex_rotary_in_real_pairs_gives_the_same_numbers() -> None:
    x, positions = torch.randn(2, 5, 3, 8), torch.arange(5).repeat(2, 1) + torch.tensor([[0], [7]])
    gm = _graph(ComplexRotary(), x, positions)
    expected = gm(x, positions)
    assert lower_complex(gm) > 0
    finish(gm)
    for node in gm.graph.nodes:
        value = node.meta.get("val")
        assert "complex" not in str(node.target), node.name
        assert not (node.op == "get_attr" and getattr(gm, node.target).is_complex()), node.name
        assert not (node.op == "call_function" and isinstance(value, torch.Tensor) and value.is_complex()), node.name
    torch.testing.assert_close(gm(x, positions)[0], expected[0], rtol=1e-5, atol=1e-5)


class ComplexExp(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.view_as_real(torch.exp(torch.view_as_complex(x)))


def test_a_complex_op_without_a_pair_form_is_refused_by_name() -> None:
    gm = _graph(ComplexExp(), torch.randn(3, 2))
    with pytest.raises(PassError, match=r"exp .*complex tensor has no real-pair form"):
        lower_complex(gm)
