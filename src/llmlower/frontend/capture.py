"""Capture transformers' own module as a Program with torch.export: dynamic batch and token count,
explicit position ids, no cache (the kv_cache pass adds one)."""

from __future__ import annotations

import torch

from ..errors import CaptureError
from ..ir.program import INPUT_IDS, LOGITS, POSITION_IDS, Program, TensorSpec, flat_graph_module
from ..progress import stage
from .checkpoint import LoadedModel
from .recurrent_capture import recurrent_capture


class CausalLMLogits(torch.nn.Module):
    """(input_ids, position_ids) -> logits of every position, through the model's own forward."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits


def capture(model: LoadedModel) -> Program:
    """torch.export of `model` as a Program: inputs input_ids and position_ids [batch, tokens] (int64),
    output logits [batch, tokens, vocab]."""
    spec = model.spec
    program = Program(
        graph_module=CausalLMLogits(model.module),  # replaced by the exported graph below
        spec=spec,
        inputs=[
            TensorSpec(INPUT_IDS, "int64", ("batch", "tokens")),
            TensorSpec(POSITION_IDS, "int64", ("batch", "tokens")),
        ],
        outputs=[TensorSpec(LOGITS, spec.dtype, ("batch", "tokens", spec.vocab_size))],
    )
    with stage(f"capture {spec.architecture} with torch.export"):
        try:
            with recurrent_capture(model.module):
                exported = program.export()
        except Exception as exc:  # torch.export raises many unrelated types; all mean "cannot capture"
            raise CaptureError(f"torch.export could not capture {spec.architecture}: {exc}") from exc
    program.graph_module = flat_graph_module(exported)
    return program
