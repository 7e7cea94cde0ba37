"""`selective_scan` and `selective_step`: Mamba's (Mamba-1's) selective scan (Jamba, Mamba, Falcon-Mamba, Zamba),
whose recurrent state replaces a growing KV cache.

Each channel keeps a state of state_size values. For token t, with dt_t = softplus(dt_t + dt_bias) (softplus when
the model asks): S <- exp(dt_t A) S + dt_t x_t B_t; y_t = C_t S + D x_t, gated by silu(z_t) when the model gives z.
Layout as transformers passes them (its kernels' channels-first one): x, dt and z [batch, channels, tokens], A
[channels, state_size], B and C [batch, state_size, tokens], D and dt_bias [channels]; y [batch, channels, tokens]
in x's dtype; the state [batch, channels, state_size] in float32.

`selective_scan` is what capture records for a whole prompt (from a zero state, no state out); the state_cache
pass turns it into `selective_step`, which starts from each sequence's state (zeros where past_lens is 0), runs its
input_lens[b] right-padded new tokens, and returns the state after its last one.
"""

from __future__ import annotations

import torch

from .registry import NAMESPACE, Cost, OpDef, register_op
from .token_scan import scan_tokens


def selective_recurrence(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, state: torch.Tensor,
    valid: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The scan over float32 x and discretised dt [batch, channels, tokens], B and C [batch, state_size, tokens] and
    a float32 state; a row's state moves only at its `valid` [batch, tokens] positions. Returns C S (without D's
    skip and the gate) [batch, channels, tokens] and the last state."""

    def update(state: torch.Tensor, x, dt, B, C, A) -> tuple[torch.Tensor, torch.Tensor]:  # one token's
        updated = torch.exp(A * dt[..., None]) * state + dt[..., None] * B[:, None, :] * x[..., None]
        return (updated * C[:, None, :]).sum(dim=-1), updated

    return scan_tokens(update, state, (x, dt, B, C), valid, torch.zeros_like(x), (A.float(),))


def _discretised(dt: torch.Tensor, dt_bias: torch.Tensor | None, softplus: bool) -> torch.Tensor:
    dt = dt.float() + (dt_bias.float()[:, None] if dt_bias is not None else 0.0)
    return torch.nn.functional.softplus(dt) if softplus else dt


def _finished(y: torch.Tensor, x: torch.Tensor, D: torch.Tensor | None, z: torch.Tensor | None) -> torch.Tensor:
    """y with D's skip connection and the silu(z) gate, in x's dtype."""
    y = y.to(x.dtype)
    if D is not None:
        y = y + x * D[:, None]
    return y * torch.nn.functional.silu(z) if z is not None else y


def selective_scan_reference(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    z: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    softplus: bool,
) -> torch.Tensor:
    batch, channels, tokens = x.shape
    state = x.new_zeros(batch, channels, A.shape[-1], dtype=torch.float32)
    valid = torch.ones(batch, tokens, dtype=torch.bool)
    y, _ = selective_recurrence(x.float(), _discretised(dt, dt_bias, softplus), A, B.float(), C.float(), state, valid)
    return _finished(y, x, D, z)


def selective_step_reference(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    z: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    state: torch.Tensor,
    past_lens: torch.Tensor,
    input_lens: torch.Tensor,
    softplus: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    start = torch.where((past_lens == 0)[:, None, None], torch.zeros_like(state), state).float()
    valid = torch.arange(x.shape[2])[None, :] < input_lens[:, None]
    dt = _discretised(dt, dt_bias, softplus)
    y, state = selective_recurrence(x.float(), dt, A, B.float(), C.float(), start, valid)
    return _finished(y, x, D, z), state


selective_scan = torch.library.custom_op(f"{NAMESPACE}::selective_scan", selective_scan_reference, mutates_args=())
selective_step = torch.library.custom_op(f"{NAMESPACE}::selective_step", selective_step_reference, mutates_args=())


@selective_scan.register_fake
def _selective_scan_fake(x, dt, A, B, C, D, z, dt_bias, softplus):
    return torch.empty_like(x)


@selective_step.register_fake
def _selective_step_fake(x, dt, A, B, C, D, z, dt_bias, state, past_lens, input_lens, softplus):
    return torch.empty_like(x), torch.empty_like(state)


def selective_cost(batch: int, tokens: int, channels: int, state_size: int, element_bytes: int) -> Cost:
    """Per token and channel: the decay (an exp), the input's update and the read by C over state_size values
    (about 7 flops each); reads x, dt, z, B and C, writes y; reads and writes the float32 state once a step."""
    state_bytes = 4 * batch * channels * state_size
    activations = element_bytes * batch * tokens * (4 * channels + 2 * state_size)
    return Cost(
        flops=7 * batch * tokens * channels * state_size,
        bytes=activations + 2 * state_bytes,
        kv_read_bytes=state_bytes,
        kv_write_bytes=state_bytes,
    )


def selective_scan_cost(batch: int, tokens: int, channels: int, state_size: int, element_bytes: int) -> Cost:
    """As selective_cost, without a state to read or write (a whole prompt from zeros)."""
    return selective_cost(batch, tokens, channels, state_size, element_bytes).without_cache_traffic()


SELECTIVE_SCAN = register_op(
    OpDef(
        "selective_scan",
        torch.ops.llmlower.selective_scan,
        "Mamba's selective scan over a whole prompt (as captured)",
        selective_scan_cost,
        selective_scan_reference,
    )
)
SELECTIVE_STEP = register_op(
    OpDef(
        "selective_step",
        torch.ops.llmlower.selective_step,
        "Mamba's selective scan over a step's new tokens, from and to each sequence's recurrent state",
        selective_cost,
        selective_step_reference,
    )
)
