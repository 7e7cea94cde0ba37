"""`causal_conv1d`: a depthwise causal convolution over a step's new tokens that carries its window across steps.

The short convolutions of the hybrid models (LFM2's mixer; the conv before Mamba's scans and Gated DeltaNet's
delta rule) read each channel's last `width` inputs. A cache keeps the `width - 1` inputs before the step as the
sequence's conv state, [batch, channels, width - 1], so a prompt in chunks and one token a step compute what the
whole prompt at once does. Layout: x is [batch, channels, tokens], sequence b's input_lens[b] new tokens
right-padded to `tokens`; weight is [channels, width]. A sequence with past_lens[b] == 0 starts from zeros (a
slot's earlier sequence leaves its state behind, as it leaves its KV entries). Returns the output [batch, channels,
tokens] (unspecified at padded positions) and the state after the sequence's last new token: the last `width - 1`
of its state and its new inputs.
"""

from __future__ import annotations

import torch

from .registry import NAMESPACE, Cost, OpDef, register_op


def causal_conv1d_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    state: torch.Tensor,
    past_lens: torch.Tensor,
    input_lens: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    channels, width = weight.shape
    fresh = (past_lens == 0)[:, None, None]
    window = torch.where(fresh, torch.zeros_like(state), state).to(x.dtype)
    full = torch.cat((window, x), dim=-1)  # [batch, channels, width - 1 + tokens]
    out = torch.nn.functional.conv1d(full, weight.unsqueeze(1), bias, groups=channels)
    # the new window ends at the sequence's last new input: full's positions input_lens .. input_lens + width - 2
    ends = input_lens[:, None, None] + torch.arange(width - 1, device=x.device)
    return out, full.gather(-1, ends.expand(-1, channels, -1)).to(state.dtype)


causal_conv1d = torch.library.custom_op(f"{NAMESPACE}::causal_conv1d", causal_conv1d_reference, mutates_args=())


@causal_conv1d.register_fake
def _causal_conv1d_fake(x, weight, bias, state, past_lens, input_lens):
    return torch.empty_like(x), torch.empty_like(state)


def causal_conv1d_cost(batch: int, tokens: int, channels: int, width: int, element_bytes: int) -> Cost:
    """A multiply-add per tap and output element; reads x, the weight and the state, writes the output and the
    state (the state is the recurrent cache's traffic, counted as KV's)."""
    state_bytes = batch * channels * (width - 1) * element_bytes
    return Cost(
        flops=2 * batch * tokens * channels * width,
        bytes=2 * batch * tokens * channels * element_bytes + channels * width * element_bytes + 2 * state_bytes,
        weight_bytes=channels * width * element_bytes,
        kv_read_bytes=state_bytes,
        kv_write_bytes=state_bytes,
    )


CAUSAL_CONV1D = register_op(
    OpDef(
        name="causal_conv1d",
        op=torch.ops.llmlower.causal_conv1d,
        summary="depthwise causal conv1d over new tokens, its window carried across steps as a conv state",
        cost=causal_conv1d_cost,
        reference=causal_conv1d_reference,
    )
)
