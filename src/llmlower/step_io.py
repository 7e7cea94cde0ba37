"""The step interface that compiled programs and the runtime share: input and output names, KV-cache tensor
names and the two KV layouts. Plain Python (no torch): the compiler and the runtime both import it.

A step runs the new tokens of several sequences at once. Every program takes `input_ids` and `position_ids`,
and, once it has a KV cache, each sequence's `past_lens` (tokens already cached) and `input_lens` (new tokens).
A program that computes the LM head only where tokens are sampled (the last_token_logits pass) also takes
`logits_indices`: the step's token positions, flattened row-major ([batch * tokens] for SLOTS, the packed row for
PAGED), whose logits it returns, [len(logits_indices), 1, vocab] — each sequence's last token in a plain step, its
last k+1 tokens when speculative decoding scores k proposed tokens at once.
How the cache is addressed is the program's KV layout:

- SLOTS: one contiguous cache per sequence slot, `k_cache_<layer>` / `v_cache_<layer>` of
  [slots, kv_heads, context, head_dim]; tokens right-padded to [batch, tokens] (ONNX Runtime's
  GroupQueryAttention updates such a cache in place on the CPU).
- PAGED: a pool of fixed-size blocks per layer, `k_pool_<layer>` / `v_pool_<layer>` of
  [num_blocks, block_size, kv_heads, head_dim], addressed by `block_tables` [seqs, max_blocks]; the step's tokens
  packed one sequence after another in a single row, [1, tokens] (ONNX Runtime's PagedAttention, vLLM's layout).

A hybrid model's recurrent layers keep a fixed-size state per sequence instead of a cache that grows:
`conv_state_<layer>` (a short convolution's last inputs), `delta_state_<layer>` (Gated DeltaNet's matrices) and
`ssm_state_<layer>` (Mamba's and Mamba-2's), [batch, ...] in the SLOTS layout, one row per slot, an input and (as
present_<name>) an updated output of the step like the caches. In the PAGED layout a state is a pool of rows
[state slots, ...] like the KV pools, each sequence's row named by `state_slots` [seqs] (the block manager gives
each sequence one), updated in place. A state is that of the sequence after its past_lens tokens; a sequence with
past_lens 0 starts from zeros whatever its row holds.

A program with LoRA adapter slots (the lora pass) also takes `lora_slots`, each token's slot (-1: the base model),
shaped as input_ids, and per adapted linear `lora_a__<module>` [slots * rank, in] and `lora_b__<module>`
[out, slots * rank]: every slot's adapter side by side (PEFT's lora_A and lora_B), which the runtime fills as
adapters load.
"""

from __future__ import annotations

import enum
import re

INPUT_IDS = "input_ids"
POSITION_IDS = "position_ids"
PAST_LENS = "past_lens"
INPUT_LENS = "input_lens"
LOGITS_INDICES = "logits_indices"
BLOCK_TABLES = "block_tables"
STATE_SLOTS = "state_slots"  # PAGED, hybrid models: each sequence's row of the recurrent states
LOGITS = "logits"
LORA_SLOTS = "lora_slots"  # a LoRA artifact's: each token's adapter slot (-1: the base model), shaped as input_ids
LORA_PREFIXES = ("lora_a__", "lora_b__")  # + a linear's module path, "." as "__": its slots' A and B side by side
PRESENT_PREFIX = "present_"  # ONNX names each value once: the updated cache k_cache_0 is output present_k_cache_0

DEFAULT_BLOCK_SIZE = 16  # tokens per KV block when nothing else says
DEFAULT_SEQUENCES = 4  # an executor's KV room when no pool size is given: this many sequences of max_context

KV_CACHE_DTYPES = ("auto", "float16", "bfloat16", "int8")  # compile --kv-cache-dtype (vLLM's words, fp8 aside)

_CACHE_NAME = re.compile(r"([kv])_(cache|pool)_(\d+)")
STATE_KINDS = ("conv", "delta", "ssm")  # the recurrent states a step may carry, each <kind>_state_<layer>
_STATE_NAME = re.compile(rf"({'|'.join(STATE_KINDS)})_state_(\d+)")


class KVLayout(str, enum.Enum):
    """How a program's KV cache is addressed (see the module docstring)."""

    SLOTS = "slots"
    PAGED = "paged"


def cache_names(layer: int) -> tuple[str, str]:
    """Names of a layer's key and value caches in the SLOTS layout (inputs, and the updated outputs)."""
    return f"k_cache_{layer}", f"v_cache_{layer}"


def pool_names(layer: int) -> tuple[str, str]:
    """Names of a layer's key and value block pools in the PAGED layout."""
    return f"k_pool_{layer}", f"v_pool_{layer}"


def cache_layer(name: str) -> int | None:
    """The layer of a KV-cache tensor name (k_cache_3, v_pool_0, ...), None for any other name."""
    match = _CACHE_NAME.fullmatch(name)
    return int(match.group(3)) if match else None


def lora_names(module: str) -> tuple[str, str]:
    """The inputs holding every adapter slot's A and B of one linear (its module path, model.layers.0.mlp.up_proj;
    an input name is an identifier, the path's dots written "__")."""
    if "__" in module:
        raise ValueError(f"module path {module!r}: a LoRA target's path may not hold '__'")
    return tuple(prefix + module.replace(".", "__") for prefix in LORA_PREFIXES)


def lora_module(name: str) -> str | None:
    """The linear's module path of a LoRA weight input's name, None for any other name."""
    for prefix in LORA_PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix) :].replace("__", ".")
    return None


def state_name(kind: str, layer: int) -> str:
    """Name of a layer's recurrent state of `kind` (one of STATE_KINDS)."""
    if kind not in STATE_KINDS:
        raise ValueError(f"state kind {kind!r}: expected one of {', '.join(STATE_KINDS)}")
    return f"{kind}_state_{layer}"


def state_layer(name: str) -> int | None:
    """The layer of a recurrent-state tensor name (conv_state_0, ...), None for any other name."""
    match = _STATE_NAME.fullmatch(name)
    return int(match.group(2)) if match else None
