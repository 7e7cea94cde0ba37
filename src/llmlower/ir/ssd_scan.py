"""`ssd_scan` and `ssd_step`: Mamba-2's selective state space scan (Granite-4.0-H, Nemotron-H, Falcon-H1, Bamba,
Zamba2, Mamba-2), whose recurrent state replaces a growing KV cache.

Each head keeps a matrix S [head_dim, state_size]. For token t, with dt_t = clamp(softplus(dt_t + dt_bias)) (softplus
when the model asks) and B, C shared by the heads of a group: S <- S * exp(dt_t A) + dt_t x_t B_t^T; y_t = S C_t +
D x_t. Layout as transformers passes them: x [batch, tokens, heads, head_dim], dt [batch, tokens, heads], A, D and
dt_bias [heads], B and C [batch, tokens, groups, state_size]; y [batch, tokens, heads, head_dim] in float32 (as
transformers' scan returns it); the state [batch, heads, head_dim, state_size] in float32.

`ssd_scan` is what capture records for a whole prompt (from a zero state, no state out); the state_cache pass turns
it into `ssd_step`, which starts from each sequence's state (zeros where past_lens is 0), runs its input_lens[b]
right-padded new tokens, and returns the state after its last one.

Two forms compute it: the recurrence above, token by token (decode), and the chunked form (prompts; chunk_scan.py):
within a chunk, with G_t the decay from the chunk's start through t, y = G (C S^T) + (C B^T * G_t / G_i) (dt x) and
S <- G_last S + (dt x G_last / G)^T B.
"""

from __future__ import annotations

import torch

from .chunk_scan import by_length, pairwise_decay, scan_chunks
from .registry import NAMESPACE, Cost, OpDef, register_op
from .token_scan import scan_tokens


def _heads_first(
    x: torch.Tensor,
    dt: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    dt_bias: torch.Tensor | None,
    softplus: bool,
    dt_min: float,
    dt_max: float,
) -> tuple[torch.Tensor, ...]:
    """float32 [batch, heads, tokens, ...] of x, the discretised dt, and B and C repeated to the heads."""
    dt = dt.float() + (dt_bias.float() if dt_bias is not None else 0.0)
    dt = torch.clamp(torch.nn.functional.softplus(dt) if softplus else dt, min=dt_min, max=dt_max)
    group = x.shape[2] // B.shape[2]
    B, C = (y.float().repeat_interleave(group, dim=2) for y in (B, C))
    return tuple(y.transpose(1, 2) for y in (x.float(), dt, B, C))


def ssd_recurrence(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, state: torch.Tensor,
    valid: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The scan over [batch, heads, tokens, ...] inputs (from _heads_first) and a float32 state; a row's state moves
    only at its `valid` [batch, tokens] positions. Returns S C (without D's skip) [batch, heads, tokens, head_dim]
    and the last state."""

    def update(state: torch.Tensor, x, dt, B, C, A) -> tuple[torch.Tensor, torch.Tensor]:  # one token's
        decay = torch.exp(dt * A)[..., None, None]
        updated = state * decay + (dt[..., None] * x)[..., None] * B[:, :, None, :]
        return (updated * C[:, :, None, :]).sum(dim=-1), updated

    return scan_tokens(update, state, (x, dt, B, C), valid, torch.zeros_like(x), (A.float(),))


def ssd_chunks(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, state: torch.Tensor,
    valid: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """ssd_recurrence's result in the chunked form: padded tokens idle (dt 0)."""
    dt = torch.where(valid[:, None], dt, 0.0)
    return scan_chunks(_ssd_chunk, state, (x, dt, B, C), (A.float(),))


def _ssd_chunk(state: torch.Tensor, x, dt, B, C, A) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk [batch, heads, size, ...] from `state` [batch, heads, head_dim, state_size]: S C at each token
    and the state after it."""
    cumulative = (dt * A[:, None]).cumsum(dim=-1)
    written = x * dt[..., None]
    y = (
        C @ state.transpose(-1, -2) * cumulative.exp()[..., None]
        + (C @ B.transpose(-1, -2) * pairwise_decay(cumulative)) @ written
    )
    last = cumulative[..., -1:]
    carried = (written * (last - cumulative).exp()[..., None]).transpose(-1, -2) @ B
    return y, state * last.exp()[..., None] + carried


_ssd = by_length(ssd_recurrence, ssd_chunks)  # the chunked form for a prompt, the recurrence otherwise


def ssd_scan_reference(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    softplus: bool,
    dt_min: float,
    dt_max: float,
) -> torch.Tensor:
    x_, dt_, B_, C_ = _heads_first(x, dt, B, C, dt_bias, softplus, dt_min, dt_max)
    batch, heads, tokens, head_dim = x_.shape
    state = x_.new_zeros(batch, heads, head_dim, B.shape[-1])
    y, _ = _ssd(x_, dt_, A, B_, C_, state, torch.ones(batch, tokens, dtype=torch.bool))
    y = y.transpose(1, 2)
    return y if D is None else y + D.float()[:, None] * x.float()


def ssd_step_reference(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    state: torch.Tensor,
    past_lens: torch.Tensor,
    input_lens: torch.Tensor,
    softplus: bool,
    dt_min: float,
    dt_max: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    x_, dt_, B_, C_ = _heads_first(x, dt, B, C, dt_bias, softplus, dt_min, dt_max)
    start = torch.where((past_lens == 0)[:, None, None, None], torch.zeros_like(state), state).float()
    valid = torch.arange(x.shape[1])[None, :] < input_lens[:, None]
    y, state = _ssd(x_, dt_, A, B_, C_, start, valid)
    y = y.transpose(1, 2)
    return (y if D is None else y + D.float()[:, None] * x.float()), state


ssd_scan = torch.library.custom_op(f"{NAMESPACE}::ssd_scan", ssd_scan_reference, mutates_args=())
ssd_step = torch.library.custom_op(f"{NAMESPACE}::ssd_step", ssd_step_reference, mutates_args=())


@ssd_scan.register_fake
def _ssd_scan_fake(x, dt, A, B, C, D, dt_bias, softplus, dt_min, dt_max):
    return x.new_empty(x.shape, dtype=torch.float32)


@ssd_step.register_fake
def _ssd_step_fake(x, dt, A, B, C, D, dt_bias, state, past_lens, input_lens, softplus, dt_min, dt_max):
    return x.new_empty(x.shape, dtype=torch.float32), torch.empty_like(state)


def ssd_cost(batch: int, tokens: int, heads: int, head_dim: int, state_size: int, element_bytes: int) -> Cost:
    """Per token and head: the decay, the input's outer product and the read by C, each head_dim x state_size (about
    6 flops an element); reads x, dt, B and C, writes y; reads and writes the float32 state once a step."""
    state_bytes = 4 * batch * heads * head_dim * state_size
    activations = element_bytes * batch * tokens * (2 * heads * head_dim + heads + 2 * state_size)
    return Cost(
        flops=6 * batch * tokens * heads * head_dim * state_size,
        bytes=activations + 2 * state_bytes,
        kv_read_bytes=state_bytes,
        kv_write_bytes=state_bytes,
    )


def ssd_scan_cost(batch: int, tokens: int, heads: int, head_dim: int, state_size: int, element_bytes: int) -> Cost:
    """As ssd_cost, without a state to read or write (a whole prompt from zeros)."""
    return ssd_cost(batch, tokens, heads, head_dim, state_size, element_bytes).without_cache_traffic()


SSD_SCAN = register_op(
    OpDef(
        "ssd_scan",
        torch.ops.llmlower.ssd_scan,
        "Mamba-2's scan over a whole prompt (as captured)",
        ssd_scan_cost,
        ssd_scan_reference,
    )
)
SSD_STEP = register_op(
    OpDef(
        "ssd_step",
        torch.ops.llmlower.ssd_step,
        "Mamba-2's scan over a step's new tokens, from and to each sequence's recurrent state",
        ssd_cost,
        ssd_step_reference,
    )
)
