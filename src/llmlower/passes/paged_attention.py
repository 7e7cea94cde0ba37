"""paged_attention: the SLOTS-layout cache (one [slots, kv_heads, context, head_dim] tensor per layer) becomes
a pool of fixed-size blocks per layer addressed by block tables (the PAGED layout of step_io).

Every `attention` / `qkv_attention` becomes `paged_attention` / `paged_qkv_attention`; the cache inputs
become pools [num_blocks, block_size, kv_heads, head_dim] and the program gains `block_tables` [seqs,
max_blocks]. The step's tokens are packed into one row ([1, tokens]): the runtime's block manager can then
share prefix blocks between sequences, admit requests by free blocks and preempt, and a step mixing a prompt
chunk with decodes wastes nothing on padding. A hybrid model's recurrent ops become their paged forms
(ir/paged_recurrent.py): each state a pool of rows [slots, ...] read and written at the new input `state_slots`
[seqs]. Run it before last_token_logits.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

from ..errors import PassError
from ..ir import (
    ATTENTION,
    LATENT_ATTENTION,
    PAGED_ATTENTION,
    PAGED_LATENT_ATTENTION,
    PAGED_QKV_ATTENTION,
    PAGED_RECURRENT,
    QKV_ATTENTION,
)
from ..ir.program import Program, TensorSpec, example_inputs
from ..step_io import (
    BLOCK_TABLES,
    DEFAULT_BLOCK_SIZE,
    INPUT_IDS,
    INPUT_LENS,
    LOGITS,
    LORA_SLOTS,
    PAST_LENS,
    POSITION_IDS,
    STATE_SLOTS,
    KVLayout,
    cache_layer,
    cache_names,
    lora_module,
    pool_names,
    state_layer,
)
from .graph_utils import finish, placeholder
from .registry import Pass, Verification, register_pass

PAGED = {
    ATTENTION.overload: PAGED_ATTENTION.overload,
    QKV_ATTENTION.overload: PAGED_QKV_ATTENTION.overload,
    LATENT_ATTENTION.overload: PAGED_LATENT_ATTENTION.overload,
}
# where each op reads its k cache (or latent), v cache (or rotary key), past_lens and input_lens
CACHE_ARGS = {ATTENTION.overload: 3, QKV_ATTENTION.overload: 1, LATENT_ATTENTION.overload: 4}


STATE_ROWS = "slots"  # the leading dimension of a state pool in the PAGED layout


def _paged_signature(program: Program, block_size: int) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """The program's inputs and outputs in the PAGED layout."""
    packed = {
        INPUT_IDS: (1, "tokens"),
        POSITION_IDS: (1, "tokens"),
        LORA_SLOTS: (1, "tokens"),
        PAST_LENS: ("seqs",),
        INPUT_LENS: ("seqs",),
    }

    def paged(t: TensorSpec) -> TensorSpec:
        layer = cache_layer(t.name)
        if layer is not None:
            name = pool_names(layer)[cache_names(layer).index(t.name)]
            return TensorSpec(name, t.dtype, ("pool", block_size, t.shape[1], t.shape[3]))
        if state_layer(t.name) is not None:
            return TensorSpec(t.name, t.dtype, (STATE_ROWS, *t.shape[1:]))
        if t.name == LOGITS:
            return TensorSpec(t.name, t.dtype, (1, "tokens", *t.shape[2:]))
        return TensorSpec(t.name, t.dtype, packed.get(t.name, t.shape))

    inputs = [paged(t) for t in program.inputs]
    added = [TensorSpec(BLOCK_TABLES, "int64", ("seqs", "blocks"))]
    if any(state_layer(name) is not None for name in program.input_names):
        added.append(TensorSpec(STATE_SLOTS, "int64", ("seqs",)))
    at = program.input_names.index(INPUT_LENS) + 1
    inputs[at:at] = added
    return inputs, [paged(t) for t in program.outputs]


def paged_attention(program: Program, block_size: int = DEFAULT_BLOCK_SIZE) -> tuple[Program, dict[str, Any]]:
    if program.kv_layout is None:
        raise PassError("paged_attention: run kv_cache first (it gives the program its per-slot KV cache)")
    if program.kv_layout is KVLayout.PAGED:
        raise PassError("paged_attention: the program is already paged")
    if program.outputs[program.output_names.index(LOGITS)].shape[1] == 1:
        raise PassError("paged_attention: run it before last_token_logits (which then picks each sequence's row)")
    if block_size < 1 or block_size & (block_size - 1):
        raise PassError(f"paged_attention: block_size must be a power of two, got {block_size}")
    gm = program.graph_module
    graph = gm.graph
    input_lens = placeholder(gm, INPUT_LENS)
    with graph.inserting_after(input_lens):
        block_tables = graph.placeholder(BLOCK_TABLES)
    state_slots = None
    if any(state_layer(name) is not None for name in program.input_names):
        with graph.inserting_after(block_tables):
            state_slots = graph.placeholder(STATE_SLOTS)
    for node in graph.find_nodes(op="placeholder"):
        layer = cache_layer(node.target)
        if layer is not None:
            with graph.inserting_before(node):
                pool = graph.placeholder(pool_names(layer)[cache_names(layer).index(node.target)])
            node.replace_all_uses_with(pool)
            graph.erase_node(node)
    rewritten = recurrent = 0
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target in PAGED_RECURRENT:
            args = list(node.args)
            args.insert([a.name for a in node.target._schema.arguments].index("state") + 1, state_slots)
            with graph.inserting_before(node):
                paged = graph.call_function(PAGED_RECURRENT[node.target], tuple(args), dict(node.kwargs))
            node.replace_all_uses_with(paged)
            graph.erase_node(node)
            recurrent += 1
        if node.op != "call_function" or node.target not in PAGED:
            continue
        first = CACHE_ARGS[node.target]
        args = list(node.args)
        args.insert(first + 2, block_tables)  # k_pool, v_pool, block_tables, past_lens, input_lens, ...
        with graph.inserting_before(node):
            paged = graph.call_function(PAGED[node.target], tuple(args), dict(node.kwargs))
        node.replace_all_uses_with(paged)
        graph.erase_node(node)
        rewritten += 1
    _batch_from_tokens(gm)
    caches = len(_cache_layers(program))
    if rewritten != caches:
        raise PassError(f"paged_attention: rewrote {rewritten} attention nodes, the program has {caches} KV caches")
    finish(gm)
    inputs, outputs = _paged_signature(program, block_size)
    stats = {"rewritten": rewritten, "recurrent": recurrent, "block_size": block_size}
    return program.with_signature(inputs, outputs), stats


def _batch_from_tokens(gm: torch.fx.GraphModule) -> None:
    """A batch size the graph reads off a per-sequence input (past_lens, input_lens, a cache or a recurrent state:
    torch.export may take the symbol from any of them) is the activations' rows: in PAGED, input_ids' one row, not
    the sequences', the pool's blocks or the state rows."""
    input_ids = placeholder(gm, INPUT_IDS)
    for node in gm.graph.find_nodes(op="call_function", target=torch.ops.aten.sym_size.int):
        source, dim = node.args
        if dim != 0 or source.op != "placeholder":
            continue
        name = source.target
        if name in (PAST_LENS, INPUT_LENS) or cache_layer(name) is not None or state_layer(name) is not None:
            node.args = (input_ids, 0)


def _cache_layers(program: Program) -> list[int]:
    """The layers with a KV cache (a hybrid model's others keep a recurrent state)."""
    return sorted({layer for name in program.input_names if (layer := cache_layer(name)) is not None})


def _verify_blocks(block_size: int) -> int:
    """Blocks per sequence in verification: two shared ones, then room for 3 more past tokens and 6 new ones."""
    return 2 + -(-9 // block_size)


def _shared_prefix_inputs(program: Program, options: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Slot inputs for verification: three sequences, the first two with the same first two blocks of past
    (their caches equal there), the third a fresh prompt."""
    block_size = options.get("block_size", DEFAULT_BLOCK_SIZE)
    context = _verify_blocks(block_size) * block_size
    inputs = example_inputs(program, batch=3, tokens=6, context=context, seed=4321)
    past = torch.tensor([2 * block_size + 3, 2 * block_size + 1, 0])
    lens = torch.tensor([6, 4, 5])
    inputs.update({PAST_LENS: past, INPUT_LENS: lens, POSITION_IDS: past[:, None] + torch.arange(6)[None, :]})
    for layer in _cache_layers(program):
        for name in cache_names(layer):
            inputs[name][1, :, : 2 * block_size] = inputs[name][0, :, : 2 * block_size]
    return inputs


def _run_paged(program: Program, slot_inputs: dict[str, torch.Tensor], options: dict[str, Any]) -> dict:
    """Run the paged program on the slot inputs' computation (blocks scattered through the pool, the shared
    prefix in shared blocks) and return its outputs in the slot layout, for comparison."""
    block_size = options.get("block_size", DEFAULT_BLOCK_SIZE)
    blocks = _verify_blocks(block_size)
    past, lens = slot_inputs[PAST_LENS], slot_inputs[INPUT_LENS]
    pool_blocks = 3 * blocks + 5  # spare blocks: the sequences' blocks are scattered among unused ones
    order = torch.randperm(pool_blocks, generator=torch.Generator().manual_seed(7)).tolist()
    own = [order[i * blocks : (i + 1) * blocks] for i in range(3)]
    tables = torch.tensor([own[0], own[0][:2] + own[1][2:], own[2]])  # sequence 1 shares sequence 0's first two
    real = torch.arange(slot_inputs[INPUT_IDS].shape[1])[None, :] < lens[:, None]
    paged = {
        INPUT_IDS: slot_inputs[INPUT_IDS][real][None],
        POSITION_IDS: slot_inputs[POSITION_IDS][real][None],
        PAST_LENS: past,
        INPUT_LENS: lens,
        BLOCK_TABLES: tables,
    }
    if LORA_SLOTS in slot_inputs:  # a program with adapter slots: each token's slot, and the slots' weights as given
        paged[LORA_SLOTS] = slot_inputs[LORA_SLOTS][real][None]
        paged |= {name: value for name, value in slot_inputs.items() if lora_module(name) is not None}
    positions = torch.arange(blocks * block_size)
    for layer in _cache_layers(program):
        for slot_name, pool_name in zip(cache_names(layer), pool_names(layer), strict=True):
            cache = slot_inputs[slot_name]  # [3, kv_heads, context, head_dim]
            pool = torch.randn(pool_blocks, block_size, cache.shape[1], cache.shape[3]).to(cache.dtype)
            for row in range(3):
                pool[tables[row, positions // block_size], positions % block_size] = cache[row].transpose(0, 1)
            paged[pool_name] = pool
    states = [name for name in slot_inputs if state_layer(name) is not None]
    slots = torch.tensor([3, 0, 4])  # the sequences' state rows, among others in a pool of 5
    for name in states:
        pool = torch.randn(5, *slot_inputs[name].shape[1:]).to(slot_inputs[name].dtype)
        pool[slots] = slot_inputs[name]
        paged[name] = pool
    if states:
        paged[STATE_SLOTS] = slots
    outputs = program(**paged)
    logits = torch.zeros((*real.shape, outputs[LOGITS].shape[-1]), dtype=outputs[LOGITS].dtype)
    logits[real] = outputs[LOGITS][0]
    result = {LOGITS: logits}
    for layer in _cache_layers(program):
        for slot_name, pool_name in zip(cache_names(layer), pool_names(layer), strict=True):
            cache = slot_inputs[slot_name].clone()
            for row, total in enumerate((past + lens).tolist()):
                where = tables[row, positions[:total] // block_size], positions[:total] % block_size
                cache[row, :, :total] = outputs[pool_name][where].transpose(0, 1)
            result[slot_name] = cache
    result |= {name: outputs[name][slots] for name in states}
    return result


register_pass(
    Pass(
        name="paged_attention",
        summary="per-slot KV cache -> block pools + block tables (paged attention), tokens packed",
        explain=(
            "Rewrites every attention / qkv_attention over the per-slot caches into paged_attention / "
            "paged_qkv_attention over per-layer pools [num_blocks, block_size, kv_heads, head_dim] (kv heads only) "
            "addressed by a new input block_tables [seqs, max_blocks]; the op writes the step's new keys and values "
            "into their blocks. The step's tokens are packed into one row (input_ids [1, tokens]) with past_lens and "
            "input_lens per sequence. A hybrid model's causal_conv1d / gated_delta_step / selective_step / ssd_step "
            "become their paged_ forms over state pools [slots, ...] addressed by a new input state_slots [seqs] "
            "(each sequence's row). Option block_size (default 16, a power of two). Run after kv_cache (and "
            "fuse_qkv_attention), before last_token_logits. --verify runs three sequences, two sharing prefix "
            "blocks, with blocks scattered through the pool, against the slot program."
        ),
        run=paged_attention,
        verification=Verification(inputs=_shared_prefix_inputs, run=_run_paged),
    )
)
