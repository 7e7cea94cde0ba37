"""Attention that transformers runs only eagerly, captured as one op of the set (`causal_attention`).

Gemma 2 (logit soft-capping) and gpt-oss (learned attention sinks) refuse SDPA (`_supports_sdpa = False`), and
their eager attention is a dozen aten ops that no pass could reliably find again. Both call transformers'
attention interface, which hands the function query [batch, heads, tokens, dk] and key / value with only the kv
heads, plus the model's extras as keyword arguments; registered as the implementation "llmlower", this module
turns each call into `causal_attention` with every extra explicit (scale, sliding window, softcap, sinks),
which the kv_cache pass rewrites into `attention` as it does SDPA. A keyword it does not know, with a value
other than the one that changes nothing, is refused: silently ignoring it would compile a different model.
"""

from __future__ import annotations

from typing import Any

import torch
import transformers
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from ..errors import CaptureError
from ..ir import CAUSAL_ATTENTION

IMPLEMENTATION = "llmlower"
# keywords the models pass that do not change what the op computes, each with the value that means so
NEUTRAL = {
    "dropout": 0.0,
    "is_causal": True,
    "output_attentions": False,
    "use_cache": False,  # the capture has no cache: kv_cache adds one
    "output_router_logits": False,  # MoE models' flag, carried down to every layer
}
# passed on by the decoder layers whatever the attention: the positions that rotary already used (each captured row
# is one sequence in order, so they mark no packed-sequence boundary the op would have to respect)
PASSED_ON = {"position_ids"}


def attn_implementation(config: transformers.PretrainedConfig) -> str:
    """The attention implementation to load a model with: "sdpa" where its class supports it (the capture the
    kv_cache pass has always read), "llmlower" (this module) for the models transformers runs only eagerly
    through its attention interface, and "eager" for those that write their attention out themselves (Bloom's
    ALiBi): their matmul + softmax + matmul, with the mask transformers builds for eager, is what the
    eager_attention pass recognises."""
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    if model_class is None or model_class._supports_sdpa:
        return "sdpa"
    return IMPLEMENTATION if model_class._supports_attention_backend else "eager"


def _check_neutral(module: torch.nn.Module, kwargs: dict[str, Any]) -> None:
    """Refuse, in one line naming it and the model, a keyword this capture would otherwise drop."""
    model = getattr(getattr(module, "config", None), "model_type", type(module).__name__)
    for name, value in kwargs.items():
        if value is not None and name not in PASSED_ON and (name not in NEUTRAL or value != NEUTRAL[name]):
            raise CaptureError(
                f"{model}: attention keyword {name}={value!r} has no counterpart in llmlower's attention op"
            )


def llmlower_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface as one `causal_attention`: the output [batch, tokens, heads, dv] that
    the interface returns (a transposed view, the transpose + reshape fuse_qkv_attention reads, as SDPA's is),
    and no attention weights. The op is causal by itself, so no mask is built for it
    (transformers builds none for an implementation without a mask function); one given is refused."""
    _check_neutral(module, {"attention_mask": attention_mask, **kwargs})
    scale = module.head_dim**-0.5 if scaling is None else scaling  # eager_attention_forward's default
    out = CAUSAL_ATTENTION.op(query, key, value, float(scale), int(sliding_window or 0), float(softcap or 0.0), s_aux)
    return out.transpose(1, 2), None  # the caller's reshape copies it: no contiguous() between the two


transformers.AttentionInterface.register(IMPLEMENTATION, llmlower_attention)
