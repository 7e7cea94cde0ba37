"""`causal_attention`: attention as transformers' attention interface calls it, captured as one op.

q is [batch, heads, tokens, dk], k [batch, kv_heads, tokens, dk] and v [batch, kv_heads, tokens, dv] (kv heads
only, before any repeat-kv); token t attends to tokens j <= t (within the window or chunk `visible` says), with the
extras of `attention` (scale, softcap, sinks, alibi_slopes; see ir/attention.py). Returns [batch, heads, tokens,
dv]. It has no cache: the kv_cache pass turns it into `attention`, passing every argument on, as it does SDPA. It exists
for the models transformers runs only eagerly (Gemma 2's soft-capping, gpt-oss's sinks), which SDPA cannot
express (frontend/attention_capture.py), and for attention written out in aten ops that the eager_attention pass
recognises (Bloom's ALiBi).
"""

from __future__ import annotations

import torch

from .attention import alibi_bias, attend, attention_cost, visible
from .registry import NAMESPACE, OpDef, register_op


def causal_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    positions = torch.arange(q.shape[2], device=q.device)
    allowed = visible(positions[None, :], positions[:, None], window)  # [tokens, tokens]
    bias = alibi_bias(alibi_slopes, positions[None, :], positions[:, None])
    return attend(q, k, v, allowed, scale, softcap, sinks, bias)


causal_attention = torch.library.custom_op(
    f"{NAMESPACE}::causal_attention", causal_attention_reference, mutates_args=()
)


@causal_attention.register_fake
def _causal_attention_fake(q, k, v, scale, window=0, softcap=0.0, sinks=None, alibi_slopes=None):
    return q.new_empty((*q.shape[:3], v.shape[-1]))


CAUSAL_ATTENTION = register_op(
    OpDef(
        name="causal_attention",
        op=torch.ops.llmlower.causal_attention,
        summary="causal attention over a step's own tokens (no cache), with softcap, sinks, ALiBi and scale explicit",
        cost=attention_cost,
        reference=causal_attention_reference,
    )
)
