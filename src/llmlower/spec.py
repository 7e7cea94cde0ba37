"""ModelSpec: what every layer of llmlower needs to know about a model, as plain data (no torch)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}  # the dtypes a model is loaded and compiled in
CACHE_DTYPE_BYTES = {**DTYPE_BYTES, "int8": 1}  # and those its KV cache is kept in


@dataclass(frozen=True)
class ModelSpec:
    """Shape and vocabulary facts of a decoder-only LM, read from its config and tokenizer."""

    architecture: str
    model_type: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    max_positions: int
    dtype: str
    rope: dict[str, Any] | None = None
    sliding_window: int | None = None
    attention_chunk_size: int | None = None  # chunked local attention's chunk (Llama 4)
    layer_types: tuple[str, ...] | None = None
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    # per layer, the elements one token adds to that layer's KV cache as the compiled program lays it out (k and
    # v heads with their own head sizes, or MLA's latent and rotary key); None before a pass lays the cache out
    kv_widths: tuple[int, ...] | None = None
    # the bytes of one sequence's recurrent state, all layers together (a hybrid model's; 0 without)
    state_bytes: int = 0
    chat_template: str | None = field(default=None, repr=False)

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def kv_bytes_per_token(self, dtype: str | None = None) -> int:
        """Bytes one token adds to the KV cache: the layers' `kv_widths` x element size once the cache is laid
        out, else 2 (k and v) x layers x kv_heads x head_dim x element size (the config's)."""
        element = CACHE_DTYPE_BYTES[dtype or self.dtype]
        if self.kv_widths is not None:
            return sum(self.kv_widths) * element
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element

    def kv_cache_bytes(self, context: int, batch: int = 1, dtype: str | None = None) -> int:
        """Bytes of a KV cache holding `context` tokens for each of `batch` sequences."""
        return self.kv_bytes_per_token(dtype) * context * batch

    def window_for_layer(self, layer: int) -> int:
        """The attention op's `window` of a layer: its sliding window's size, minus its chunk's size for chunked
        local attention, 0 for full attention."""
        kind = self.layer_types[layer] if self.layer_types else None
        if self.attention_chunk_size and kind in (None, "chunked_attention"):
            return -self.attention_chunk_size
        if self.sliding_window and kind in (None, "sliding_attention"):
            return self.sliding_window
        return 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelSpec:
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        for key in ("eos_token_ids", "layer_types", "kv_widths"):
            if values.get(key) is not None:
                values[key] = tuple(values[key])
        return cls(**values)
