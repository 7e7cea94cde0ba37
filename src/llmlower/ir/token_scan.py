"""A recurrence over a step's tokens, as the recurrent ops' references run it: one body, a Python loop when run on
real tensors, one `while_loop` when traced. Traced with a symbolic token count (an export for MLIR), a Python loop
cannot unroll; the while_loop stays one loop (MLIR's scf.while) that reads token t with a dynamic slice and
writes its output row with a dynamic slice update."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch._guards import detect_fake_mode
from torch._higher_order_ops.while_loop import while_loop_op

TOKENS = 2  # the token dimension of a scan's inputs and output ([batch, heads or channels, tokens, ...])

# update(state, *inputs at token t) -> (the output at t, the state after t)
Update = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def scan_tokens(
    update: Update,
    state: torch.Tensor,
    inputs: Sequence[torch.Tensor],
    valid: torch.Tensor,
    output: torch.Tensor,
    constants: Sequence[torch.Tensor] = (),
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run `update(state, *inputs at t, *constants)` over the tokens of `inputs` (each with its tokens at dimension
    TOKENS), from `state`; row b's state moves only at its `valid` [batch, tokens] positions. `output` is zeros of
    the stacked outputs' shape and dtype; `constants`, tensors every token reads whole (passed, not closed over: a
    traced loop takes no tensor from outside). Returns the outputs stacked at TOKENS and the last state."""
    count = len(inputs)
    if detect_fake_mode((state, *inputs)) is None:
        outputs = []
        for t in range(valid.shape[1]):
            at = [x.select(TOKENS, t) for x in inputs]
            out, state = _advance(update, state, [*at, *constants], valid[:, t])
            outputs.append(out)
        return torch.stack(outputs, dim=TOKENS), state

    def more(t: torch.Tensor, state: torch.Tensor, output: torch.Tensor, valid: torch.Tensor, *inputs: torch.Tensor):
        return t < valid.shape[1]

    def body(t: torch.Tensor, state: torch.Tensor, output: torch.Tensor, valid: torch.Tensor, *inputs: torch.Tensor):
        i = t.item()
        torch._check(i >= 0)
        torch._check(i < valid.shape[1])
        at = [x.narrow(TOKENS, i, 1).squeeze(TOKENS) for x in inputs[:count]]
        out, state = _advance(update, state, [*at, *inputs[count:]], valid.narrow(1, i, 1).squeeze(1))
        output = output.slice_scatter(out.unsqueeze(TOKENS).to(output.dtype), TOKENS, i, i + 1)
        # every carry is returned (the MLIR importer takes no values closed over) as a new tensor, as while_loop asks
        return t + 1, state, output, valid.clone(), *(x.clone() for x in inputs)

    start = torch.zeros((), dtype=torch.int64)
    # the operator itself: under a tracer already (an export's decompositions), not while_loop's own compile
    _, state, output, *_ = while_loop_op(more, body, (start, state, output, valid, *inputs, *constants), ())
    return output, state


def _advance(
    update: Update, state: torch.Tensor, at: Sequence[torch.Tensor], valid: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token: its output, and the state after it where the token is valid (else the state before it)."""
    out, updated = update(state, *at)
    keep = valid.reshape(-1, *[1] * (state.dim() - 1))
    return out, torch.where(keep, updated, state)
