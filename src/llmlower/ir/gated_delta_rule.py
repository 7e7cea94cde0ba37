"""`gated_delta_rule` and `gated_delta_step`: Gated DeltaNet's linear attention (Qwen3-Next, Qwen3.5), whose
recurrent state replaces a growing KV cache.

Each value head keeps a matrix S [dk, dv]. For token t, with the query and key L2-normalised when the model asks
(use_qk_l2norm) and the query scaled by 1/sqrt(dk): S <- S * exp(g_t); S <- S + k_t (beta_t (v_t - k_t S)); out_t =
q_t S. Query and key heads may be fewer than value heads (each serves hv / hk consecutive value heads). Layout as
transformers passes them: q and k [batch, tokens, hk, dk], v [batch, tokens, hv, dv], g and beta [batch, tokens,
hv]; out [batch, tokens, hv, dv] in q's dtype; the state [batch, hv, dk, dv] is float32, as transformers keeps it.

`gated_delta_rule` is what capture records for a whole prompt (from a zero state, no state out); the state_cache
pass turns it into `gated_delta_step`, which starts from each sequence's state (zeros where past_lens is 0), runs
its input_lens[b] right-padded new tokens, and returns the state after its last one.

Two forms compute it: the recurrence above, token by token (decode), and the chunked form (prompts; chunk_scan.py):
within a chunk, with G_t the decay from the chunk's start through t, the state's corrections u solve the unit lower
triangular system (I + tril(beta_t G_t / G_i k_t . k_i)) u = beta v - beta G K S, then out = G Q S + (Q K^T * G_t /
G_i) u and S <- G_last S + (K G_last / G)^T u.
"""

from __future__ import annotations

import torch

from .chunk_scan import by_length, pairwise_decay, scan_chunks
from .registry import NAMESPACE, Cost, OpDef, register_op
from .token_scan import scan_tokens


def _heads_first(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, use_qk_l2norm: bool
) -> tuple[torch.Tensor, ...]:
    """float32 [batch, hv, tokens, ...] of each, q and k normalised (if asked) and repeated to the value heads, q
    scaled by 1/sqrt(dk)."""
    group = v.shape[2] // k.shape[2]
    q, k = (x.repeat_interleave(group, dim=2) if group > 1 else x for x in (q, k))
    q, k, v, g, beta = (x.transpose(1, 2).float() for x in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = (x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6) for x in (q, k))
    return q / q.shape[-1] ** 0.5, k, v, g, beta


def delta_recurrence(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    valid: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence over [batch, hv, tokens, ...] inputs (from _heads_first) and a float32 state; a row's state
    moves only at its `valid` [batch, tokens] positions. Returns out [batch, hv, tokens, dv] and the last state."""

    def update(state: torch.Tensor, q, k, v, g, beta) -> tuple[torch.Tensor, torch.Tensor]:  # one token's
        decayed = state * g.exp()[..., None, None]
        delta = (v - (decayed * k[..., None]).sum(dim=-2)) * beta[..., None]
        updated = decayed + k[..., None] * delta[..., None, :]
        return (updated * q[..., None]).sum(dim=-2), updated

    return scan_tokens(update, state, (q, k, v, g, beta), valid, torch.zeros_like(v))


def delta_chunks(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
    valid: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """delta_recurrence's result in the chunked form: padded tokens idle (g and beta 0)."""
    idle = valid[:, None]
    g, beta = torch.where(idle, g, 0.0), torch.where(idle, beta, 0.0)
    return scan_chunks(_delta_chunk, state, (q, k, v, g, beta))


def _delta_chunk(state: torch.Tensor, q, k, v, g, beta) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk [batch, hv, size, ...] from `state`: its outputs and the state after it."""
    cumulative = g.cumsum(dim=-1)
    decay = pairwise_decay(cumulative)
    k_beta = k * beta[..., None]
    system = torch.eye(g.shape[-1]) + (k_beta @ k.transpose(-1, -2) * decay).tril(-1)
    targets = v * beta[..., None] - (k_beta * cumulative.exp()[..., None]) @ state
    corrections = torch.linalg.solve_triangular(system, targets, upper=False, unitriangular=True)
    out = (q * cumulative.exp()[..., None]) @ state + (q @ k.transpose(-1, -2) * decay) @ corrections
    last = cumulative[..., -1:]
    carried = (k * (last - cumulative).exp()[..., None]).transpose(-1, -2) @ corrections
    return out, state * last.exp()[..., None] + carried


_delta = by_length(delta_recurrence, delta_chunks)  # the chunked form for a prompt, the recurrence otherwise


def gated_delta_rule_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, use_qk_l2norm: bool
) -> torch.Tensor:
    q_, k_, v_, g_, beta_ = _heads_first(q, k, v, g, beta, use_qk_l2norm)
    batch, heads, tokens, dk = k_.shape
    state = q_.new_zeros(batch, heads, dk, v_.shape[-1])
    out, _ = _delta(q_, k_, v_, g_, beta_, state, torch.ones(batch, tokens, dtype=torch.bool))
    return out.transpose(1, 2).to(q.dtype)


def gated_delta_step_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    past_lens: torch.Tensor,
    input_lens: torch.Tensor,
    use_qk_l2norm: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    q_, k_, v_, g_, beta_ = _heads_first(q, k, v, g, beta, use_qk_l2norm)
    start = torch.where((past_lens == 0)[:, None, None, None], torch.zeros_like(state), state)
    valid = torch.arange(q.shape[1])[None, :] < input_lens[:, None]
    out, state = _delta(q_, k_, v_, g_, beta_, start.float(), valid)
    return out.transpose(1, 2).to(q.dtype), state


gated_delta_rule = torch.library.custom_op(
    f"{NAMESPACE}::gated_delta_rule", gated_delta_rule_reference, mutates_args=()
)
gated_delta_step = torch.library.custom_op(
    f"{NAMESPACE}::gated_delta_step", gated_delta_step_reference, mutates_args=()
)


@gated_delta_rule.register_fake
def _gated_delta_rule_fake(q, k, v, g, beta, use_qk_l2norm):
    return q.new_empty((*v.shape[:3], v.shape[-1]))


@gated_delta_step.register_fake
def _gated_delta_step_fake(q, k, v, g, beta, state, past_lens, input_lens, use_qk_l2norm):
    return q.new_empty((*v.shape[:3], v.shape[-1])), torch.empty_like(state)


def gated_delta_cost(batch: int, tokens: int, heads: int, dk: int, dv: int, element_bytes: int) -> Cost:
    """Per token and value head: the decay, the key's prediction, the update and the query's read, each dk x dv
    (about 8 flops an element); reads q, k, v, writes out; reads and writes the float32 state once a step (the
    recurrence keeps it in registers or cache between tokens)."""
    state_bytes = 4 * batch * heads * dk * dv
    activations = element_bytes * batch * tokens * heads * (2 * dk + 2 * dv + 2)
    return Cost(
        flops=8 * batch * tokens * heads * dk * dv,
        bytes=activations + 2 * state_bytes,
        kv_read_bytes=state_bytes,
        kv_write_bytes=state_bytes,
    )


def gated_delta_rule_cost(batch: int, tokens: int, heads: int, dk: int, dv: int, element_bytes: int) -> Cost:
    """As gated_delta_cost, without a state to read or write (a whole prompt from zeros)."""
    return gated_delta_cost(batch, tokens, heads, dk, dv, element_bytes).without_cache_traffic()


GATED_DELTA_RULE = register_op(
    OpDef(
        "gated_delta_rule",
        torch.ops.llmlower.gated_delta_rule,
        "Gated DeltaNet over a whole prompt from a zero state (as captured)",
        gated_delta_rule_cost,
        gated_delta_rule_reference,
    )
)
GATED_DELTA_STEP = register_op(
    OpDef(
        "gated_delta_step",
        torch.ops.llmlower.gated_delta_step,
        "Gated DeltaNet over a step's new tokens, from and to each sequence's recurrent state",
        gated_delta_cost,
        gated_delta_step_reference,
    )
)
