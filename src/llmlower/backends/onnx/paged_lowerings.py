"""ONNX lowerings of the PAGED ops (`paged_attention`, `paged_qkv_attention`) to ONNX Runtime's
com.microsoft.PagedAttention (CUDA EP only; float16 / bfloat16 only).

Plain traced functions like lowerings.py's. The op takes the packed tokens as a 2-D (tokens, hidden) tensor,
the per-layer pools [num_blocks, block_size, kv_heads, head_dim] as they are (it writes this step's keys and
values into them in place: its cache outputs alias the inputs, so a runtime binds each pool as both), and
int32 sequence metadata computed here in the graph from the program's int64 inputs:
cumulative_sequence_length = [0, cumsum(input_lens)], past_seqlens = past_lens, block_table = block_tables.
Each new token t of sequence s sits at position past_lens[s] + t, which is also the row of the rotary
tables PagedAttention reads when it rotates q and k itself (do_rotary), as `paged_qkv_attention` does.
"""

from __future__ import annotations

import onnxscript
from onnxscript import opset18 as op

from .schemas import ensure_schema

MSFT = onnxscript.values.Opset("com.microsoft", 1)
INT32 = onnxscript.onnx_types.INT32.dtype
ATTENTION_BIAS = 10  # GroupQueryAttention's input index of the additive logits [batch, heads, tokens, total]
HEAD_SINK = 11  # GroupQueryAttention's and PagedAttention's input index of the per-head sink logits
K_SCALE, V_SCALE = 12, 13  # GroupQueryAttention's input indices of an int8 cache's scales
PAGED_DTYPES = ("float16",)  # PagedAttention also takes bfloat16; llmlower's CUDA executor keeps float16 pools

ensure_schema("com.microsoft", "PagedAttention", outputs=3)  # output, key_cache_out, value_cache_out


def _sequence_metadata(block_tables, past_lens, input_lens):
    """PagedAttention's cumulative_sequence_length [seqs + 1], past_seqlens [seqs] and block_table, int32."""
    cumulative = op.Concat(op.Constant(value_ints=[0]), op.CumSum(input_lens, op.Constant(value_int=0)), axis=0)
    return op.Cast(cumulative, to=INT32), op.Cast(past_lens, to=INT32), op.Cast(block_tables, to=INT32)


def attention_extras(
    given: int, softcap: float, sinks, like, bias=None, k_scale=None, v_scale=None
) -> tuple[list, dict]:
    """The inputs after the `given` first ones up to the last extra given: `bias` as GroupQueryAttention's
    attention_bias (input 10; PagedAttention's input 10 is slot_mapping, and it takes no bias), the sinks as
    head_sink (input 11 of both, in the activations' type) and an int8 cache's scales (GroupQueryAttention's
    k_scale / v_scale, PER_CHANNEL); and the attributes: softcap, the caches' quantization. Nothing for extras that
    are off, so that a model without them gets the node it always had. onnxruntime 1.31's CPU GroupQueryAttention
    takes them all (tests/test_eager_attention.py, tests/test_alibi.py, tests/test_kv_cache_dtype.py)."""
    extras = {
        ATTENTION_BIAS: bias,
        HEAD_SINK: None if sinks is None else op.CastLike(sinks, like),
        K_SCALE: k_scale,
        V_SCALE: v_scale,
    }
    last = max((index for index, value in extras.items() if value is not None), default=given - 1)
    attributes: dict = {"softcap": float(softcap)} if softcap else {}
    if k_scale is not None:
        attributes.update(k_quant_type="PER_CHANNEL", v_quant_type="PER_CHANNEL", kv_cache_bit_width=8)
    return [extras.get(index) for index in range(given, last + 1)], attributes


def _window(window: int) -> int:
    return window if window > 0 else -1  # as GroupQueryAttention's local_window_size in lowerings.py


def _rows(x, heads: int, head_dim: int):
    """[1, heads, tokens, head_dim] -> [tokens, heads * head_dim] (PagedAttention's packed layout)."""
    return op.Reshape(op.Transpose(x, perm=[0, 2, 1, 3]), op.Constant(value_ints=[-1, heads * head_dim]))


def paged_attention(
    q,
    k,
    v,
    k_pool,
    v_pool,
    block_tables,
    past_lens,
    input_lens,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    sinks=None,
    alibi_slopes=None,  # always None: export.check_lowerable refuses ALiBi, which PagedAttention has no input for
):
    """One PagedAttention on q, k, v already rotated: heads-first [1, heads, tokens, head_dim] in and out."""
    heads, head_dim, kv_heads = q.shape[1], q.shape[3], k.shape[1]
    tail, softcapping = attention_extras(8, softcap, sinks, q)
    out, k_pool, v_pool = MSFT.PagedAttention(
        _rows(q, heads, head_dim),
        _rows(k, kv_heads, head_dim),
        _rows(v, kv_heads, head_dim),
        k_pool,
        v_pool,
        *_sequence_metadata(block_tables, past_lens, input_lens),
        *tail,
        num_heads=heads,
        kv_num_heads=kv_heads,
        scale=scale,
        local_window_size=_window(window),
        **softcapping,
    )
    out = op.Reshape(out, op.Constant(value_ints=[1, -1, heads, head_dim]))
    return op.Transpose(out, perm=[0, 2, 1, 3]), k_pool, v_pool


def paged_qkv_attention(
    qkv,
    k_pool,
    v_pool,
    block_tables,
    past_lens,
    input_lens,
    cos_table,
    sin_table,
    heads: int,
    kv_heads: int,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    sinks=None,
    alibi_slopes=None,  # always None: export.check_lowerable refuses ALiBi, which PagedAttention has no input for
):
    """One PagedAttention on the packed projection [1, tokens, (heads + 2 kv_heads) head_dim], rotating q and k
    itself (do_rotary with the [positions, head_dim / 2] tables); returns [1, tokens, heads * head_dim]."""
    width = qkv.shape[2]
    if cos_table.dtype != qkv.dtype:  # the op reads its rotary tables in the activations' type
        cos_table, sin_table = op.CastLike(cos_table, qkv), op.CastLike(sin_table, qkv)
    tail, softcapping = attention_extras(10, softcap, sinks, qkv)
    out, k_pool, v_pool = MSFT.PagedAttention(
        op.Reshape(qkv, op.Constant(value_ints=[-1, width])),
        None,
        None,
        k_pool,
        v_pool,
        *_sequence_metadata(block_tables, past_lens, input_lens),
        cos_table,
        sin_table,
        *tail,
        num_heads=heads,
        kv_num_heads=kv_heads,
        scale=scale,
        local_window_size=_window(window),
        do_rotary=1,
        **softcapping,
    )
    return op.Unsqueeze(out, op.Constant(value_ints=[0])), k_pool, v_pool
