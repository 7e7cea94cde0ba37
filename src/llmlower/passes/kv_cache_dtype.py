"""kv_cache_dtype: keep the KV cache in a narrower dtype than the model's: float16 or bfloat16 (a float32 model's
cache in half its bytes, cast on the way in and out), or int8 with one scale per kv head and channel fixed at
compile time.

For int8 the pass runs the program once on calibration tokens (a prompt of real text, tokenized by the caller) with an
empty float cache, takes each layer's largest |key| and |value| per kv head and channel over those tokens from
the caches it returns (keys as the cache holds them: after the rotary embedding), and makes that the top of the
int8 range (scale = max / 127). The caches become int8 inputs and outputs, and each attention gets its layer's
k_scale / v_scale [1, kv_heads, 1, head_dim] (ir/attention.py: written as round(x / scale), read as int8 * scale;
ONNX Runtime's GroupQueryAttention takes exactly this, PER_CHANNEL). A quarter of a float32 cache's bytes, half
of a float16 one's.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
import torch.fx

from ..errors import PassError
from ..ir.attention import ATTENTION, quantize_kv
from ..ir.paged_attention import PAGED_ATTENTION, pool_scale
from ..ir.paged_qkv_attention import PAGED_QKV_ATTENTION
from ..ir.program import (
    INPUT_IDS,
    INPUT_LENS,
    LOGITS,
    LOGITS_INDICES,
    PAST_LENS,
    POSITION_IDS,
    Program,
    example_inputs,
    paged_example_inputs,
)
from ..ir.qkv_attention import QKV_ATTENTION
from ..ir.rope import ROPE
from ..step_io import (
    BLOCK_TABLES,
    KV_CACHE_DTYPES,
    LORA_SLOTS,
    STATE_SLOTS,
    KVLayout,
    cache_layer,
    lora_module,
    state_layer,
)
from .registry import Pass, Tensors, Verification, register_pass

INT8_MAX = 127
CACHE_DTYPES = tuple(d for d in KV_CACHE_DTYPES if d != "auto")  # what the pass makes: --kv-cache-dtype's others
HEADROOM = 1.25  # the calibrated peak sits at 127 / 1.25: keys a bit beyond it (another text) are not clipped
# each attention's k and v cache (or pool) argument positions
CACHE_ARGUMENTS = {
    ATTENTION.overload: (3, 4),
    QKV_ATTENTION.overload: (1, 2),
    PAGED_ATTENTION.overload: (3, 4),
    PAGED_QKV_ATTENTION.overload: (1, 2),
}
ROTATING = (QKV_ATTENTION.overload, PAGED_QKV_ATTENTION.overload)  # they rotate the keys they cache


def calibration_inputs(program: Program, ids: list[int], every_logit: bool = False) -> dict[str, torch.Tensor]:
    """One sequence of `ids` as a whole prompt, with empty float caches of exactly its length (PAGED: pools of
    as many blocks, in order), a hybrid model's recurrent states at zero and no LoRA adapter; a program that
    computes only the last token's logits computes every token's with `every_logit` (what its LM head sees for all
    of them)."""
    tokens = len(ids)
    paged = program.kv_layout is KVLayout.PAGED
    blocks = -(-tokens // program.block_size) if paged else 0
    values = {
        INPUT_IDS: torch.tensor([ids]),
        POSITION_IDS: torch.arange(tokens)[None],
        PAST_LENS: torch.zeros(1, dtype=torch.int64),
        INPUT_LENS: torch.tensor([tokens]),
        LOGITS_INDICES: torch.arange(tokens) if every_logit else torch.tensor([tokens - 1]),
        BLOCK_TABLES: torch.arange(blocks)[None],
        STATE_SLOTS: torch.zeros(1, dtype=torch.int64),  # PAGED: the sequence's row of each state pool
        LORA_SLOTS: torch.full((1, tokens), -1),  # the base model: calibration knows no adapter
    }
    sizes = {"batch": 1, "context": tokens, "pool": blocks, "slots": 1}
    for spec in program.inputs:
        if cache_layer(spec.name) is not None or state_layer(spec.name) is not None or lora_module(spec.name):
            shape = [sizes.get(d, d) for d in spec.shape]
            values[spec.name] = torch.zeros(shape, dtype=getattr(torch, spec.dtype))
    return {name: values[name] for name in program.input_names}


def as_slots(cache: torch.Tensor, paged: bool, tokens: int) -> torch.Tensor:
    """A calibration cache as [1, kv_heads, tokens, head_dim]: itself, or its pool's first `tokens` positions."""
    if not paged:
        return cache
    return cache.flatten(0, 1)[:tokens].transpose(0, 1)[None]


def peaks(cache: torch.Tensor, rotated: bool) -> torch.Tensor:
    """[1, kv_heads, 1, head_dim]: the largest |value| of each head and channel over the cached tokens. For rotated
    keys, each rotate_half pair's largest norm (both channels of the pair): a rotation moves a key's magnitude
    between the two, so a later position can put all of it in either, which a short calibration text never shows
    for the slow frequencies."""
    cache = cache.float()
    if not rotated:
        return cache.abs().amax(dim=(0, 2), keepdim=True)
    half = cache.shape[-1] // 2
    norms = torch.sqrt(cache[..., :half] ** 2 + cache[..., half:] ** 2).amax(dim=(0, 2), keepdim=True)
    return torch.cat((norms, norms), dim=-1)


def calibrated_scales(program: Program, ids: list[int], headroom: float, rotated: set[str]) -> dict[str, torch.Tensor]:
    """Each cache's scale [1, kv_heads, 1, head_dim]: its peaks over `ids` (those of `rotated` as rotary pairs)
    times `headroom`, / 127 (a channel that stayed zero gets the smallest scale of its cache, so that it still holds
    what comes later)."""
    caches = program(**calibration_inputs(program, ids))
    paged = program.kv_layout is KVLayout.PAGED
    scales = {}
    for name, cache in caches.items():
        if cache_layer(name) is None:
            continue
        peak = peaks(as_slots(cache, paged, len(ids)), name in rotated)
        floor = peak[peak > 0].min() if bool((peak > 0).any()) else torch.tensor(1.0)
        scales[name] = torch.where(peak > 0, peak, floor) * headroom / INT8_MAX
    return scales


def _rotated_keys(node: torch.fx.Node) -> bool:
    """Whether an attention's keys reach the cache rotated over the whole head (rotate_half): qkv_attention rotates
    them itself; attention's may come straight from a rope."""
    if node.target in ROTATING:
        return True
    keys = node.args[1]
    return isinstance(keys, torch.fx.Node) and keys.op == "call_function" and keys.target is ROPE.overload


def _attention_nodes(program: Program) -> list[torch.fx.Node]:
    nodes = [n for n in program.graph_module.graph.nodes if n.op == "call_function" and n.target in CACHE_ARGUMENTS]
    others = [
        n.name
        for n in program.graph_module.graph.nodes
        if n.op == "call_function" and "attention" in str(n.target) and n.target not in CACHE_ARGUMENTS
    ]
    if others:
        kinds = "(paged_)attention and (paged_)qkv_attention"
        raise PassError(f"kv_cache_dtype: narrow caches are for {kinds}, not {others[0]}")
    return nodes


def kv_cache_dtype(
    program: Program, dtype: str = "int8", calibration: list[int] = (), headroom: float = HEADROOM
) -> tuple[Program, dict]:
    if dtype not in CACHE_DTYPES:
        raise PassError(f"kv_cache_dtype: dtype {dtype!r}: one of {', '.join(CACHE_DTYPES)}")
    if program.kv_layout is None:
        raise PassError("kv_cache_dtype: run kv_cache first (it gives the program its KV cache)")
    if dtype != "int8":
        return narrow_float_caches(program, dtype)
    if len(calibration) < 2:
        raise PassError("kv_cache_dtype: calibration needs at least two token ids")
    if headroom < 1:
        raise PassError(f"kv_cache_dtype: headroom {headroom} would clip the calibration text's own keys")
    program = program.with_fresh_meta()
    nodes = _attention_nodes(program)
    for node in nodes:
        k_cache, v_cache = (node.args[i] for i in CACHE_ARGUMENTS[node.target])
        if k_cache.meta["val"].shape[-1] != v_cache.meta["val"].shape[-1]:
            raise PassError(f"kv_cache_dtype: {node.name}'s values have a head size of their own (no int8 cache)")
    rotated = {node.args[CACHE_ARGUMENTS[node.target][0]].target for node in nodes if _rotated_keys(node)}
    scales = calibrated_scales(program, list(calibration), headroom, rotated)
    gm = program.graph_module
    for node in nodes:
        extras = {}
        for kind, index in zip(("k_scale", "v_scale"), CACHE_ARGUMENTS[node.target], strict=True):
            cache = node.args[index]
            buffer = f"kv_{cache.target}_scale"
            gm.register_buffer(buffer, scales[cache.target])
            with gm.graph.inserting_before(node):
                extras[kind] = gm.graph.get_attr(buffer)
        node.kwargs = {**node.kwargs, **extras}
    gm.recompile()
    program = with_cache_dtype(program, set(scales), "int8")
    return program, {"int8_caches": len(scales), "calibration_tokens": len(calibration)}


def narrow_float_caches(program: Program, dtype: str) -> tuple[Program, dict]:
    """Every cache in `dtype` (the attentions cast what they write and read: ir/attention.py)."""
    if program.spec.dtype == dtype:
        raise PassError(f"kv_cache_dtype: the model's caches are {dtype} already")
    _attention_nodes(program)  # attentions that cannot take one are refused
    caches = {t.name for t in program.inputs if cache_layer(t.name) is not None}
    return with_cache_dtype(program, caches, dtype), {f"{dtype}_caches": len(caches)}


def with_cache_dtype(program: Program, caches: set[str], dtype: str) -> Program:
    """The program with the inputs and outputs named in `caches` of `dtype`, re-exported."""
    signature = [
        [replace(t, dtype=dtype) if t.name in caches else t for t in specs]
        for specs in (program.inputs, program.outputs)
    ]
    return program.with_signature(*signature).reexport()


def _fresh_prompts(program: Program, options: dict[str, Any]) -> Tensors:
    """--verify's inputs: prompts with nothing cached, so that the logits depend only on what the step writes."""
    if program.kv_layout is KVLayout.PAGED:
        blocks = -(-8 // program.block_size)
        return paged_example_inputs(program, 3, 12, blocks, 3 * blocks + 2, past_max=0, seed=1234)
    return example_inputs(program, batch=3, tokens=6, context=8, past_max=0, seed=1234)


def _logits_of_narrow_cache(program: Program, inputs: Tensors, options: dict[str, Any]) -> Tensors:
    """The narrow-cache program's logits on the float program's inputs (their caches cast or quantized)."""
    shaped = pool_scale if program.kv_layout is KVLayout.PAGED else (lambda scale: scale)
    gm = program.graph_module
    dtypes = {t.name: getattr(torch, t.dtype) for t in program.inputs}
    narrowed = {}
    for name, value in inputs.items():
        if cache_layer(name) is not None:
            scale = getattr(gm, f"kv_{name}_scale", None)
            value = quantize_kv(value, None if scale is None else shaped(scale), dtypes[name])
        narrowed[name] = value
    return {LOGITS: program(**narrowed)[LOGITS]}


register_pass(
    Pass(
        name="kv_cache_dtype",
        summary="a KV cache narrower than the model: float16/bfloat16, or int8 with calibrated per-channel scales",
        explain=(
            "dtype float16 or bfloat16: the caches (or pools) become inputs and outputs of that dtype, half of "
            "float32's bytes; the attentions cast what they write and read. dtype int8 (the default): runs the "
            "program once on calibration tokens with an empty cache, takes each layer's largest |value| per kv head "
            "and channel (for keys rotated by rope, each rotate_half pair's largest norm, which any later position "
            "may put in either channel), times a headroom (1.25), as int8's 127, and gives every (paged_)attention "
            "or (paged_)qkv_attention its layer's k_scale and v_scale: new keys and values are stored as int8 steps "
            "of the scale, the cache is read as int8 * scale. The caches (or pools) become int8 inputs and outputs: "
            "a quarter of float32's bytes. Verified on the logits of prompts."
        ),
        run=kv_cache_dtype,
        tolerance=lambda options: 0.1 if options.get("dtype", "int8") == "int8" else 0.02,
        verification=Verification(inputs=_fresh_prompts, run=_logits_of_narrow_cache),
        calibrated=True,
    )
)
