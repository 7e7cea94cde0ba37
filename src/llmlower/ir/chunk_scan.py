"""The chunked (parallel) form of the matrix-state recurrences, for prompts.

The tokens split into chunks of up to CHUNK. Within a chunk, every token's output and the chunk's effect on the
state are matrix products over the chunk's tokens (work a core does at matmul speed); only the state passes from
one chunk to the next, so a prompt of T tokens takes T / CHUNK sequential steps instead of T. A token that is not
valid (right padding) is made idle (no decay, no write), so it leaves the state exactly as it is.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch._guards import detect_fake_mode

from .token_scan import TOKENS

CHUNK = 64  # tokens a chunk: the intra-chunk products grow with its square, the sequential steps shrink with it

# chunk(state, *inputs of one chunk [batch, heads, size, ...], *constants) -> (its outputs, the state after it)
Chunk = Callable[..., tuple[torch.Tensor, torch.Tensor]]

# form(first input, ...) -> (outputs, last state): a scan over [batch, heads, tokens, ...] inputs, either form
Form = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def by_length(recurrence: Form, chunked: Form) -> Form:
    """A scan that runs `chunked` on a prompt (more than one token) of real tensors and `recurrence` otherwise: a
    decode token, or a traced reference (an export for MLIR, whose token count is symbolic)."""

    def scan(first: torch.Tensor, *rest: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        prompt = detect_fake_mode(first) is None and first.shape[TOKENS] > 1
        return (chunked if prompt else recurrence)(first, *rest)

    return scan


def pairwise_decay(cumulative: torch.Tensor) -> torch.Tensor:
    """exp(cumulative[t] - cumulative[i]) for i <= t, else 0: the decay from token i to token t of a chunk, from
    the cumulative log decay [..., size]. Returns [..., size, size]."""
    size = cumulative.shape[-1]
    causal = torch.ones(size, size, dtype=torch.bool).tril()
    gap = cumulative[..., :, None] - cumulative[..., None, :]
    return torch.where(causal, gap, float("-inf")).exp()


def scan_chunks(
    chunk: Chunk,
    state: torch.Tensor,
    inputs: Sequence[torch.Tensor],
    constants: Sequence[torch.Tensor] = (),
    size: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run `chunk` over `inputs` ([batch, heads, tokens, ...], idle where padded) in chunks of `size` tokens (the
    last one zero-padded, which is idle too), from `state`. Returns the outputs [batch, heads, tokens, ...] and the
    last state."""
    tokens = inputs[0].shape[TOKENS]
    padding = -tokens % size
    padded = [torch.nn.functional.pad(x, (0, 0) * (x.dim() - 1 - TOKENS) + (0, padding)) for x in inputs]
    outputs = []
    for start in range(0, tokens + padding, size):
        out, state = chunk(state, *(x.narrow(TOKENS, start, size) for x in padded), *constants)
        outputs.append(out)
    return torch.cat(outputs, dim=TOKENS).narrow(TOKENS, 0, tokens), state
