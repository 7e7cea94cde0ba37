"""last_token_logits: run the LM head only on each sequence's last new token, the one that is sampled.

A prefill of a 500-token prompt then multiplies one row by the [vocab, hidden] LM head instead of 500.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import PassError
from ..ir.program import INPUT_LENS, LOGITS, Program, TensorSpec
from ..ir.qlinear import QLINEAR
from ..step_io import KVLayout
from .graph_utils import finish, lm_head, output_node_for, placeholder
from .registry import Pass, register_pass

aten = torch.ops.aten
HEADS = {aten.linear.default, QLINEAR.overload}


def last_token_logits(program: Program) -> tuple[Program, dict[str, Any]]:
    if not program.has_kv_cache:
        raise PassError("last_token_logits: run kv_cache first (its input_lens say which token is last)")
    logits_spec = program.outputs[program.output_names.index(LOGITS)]
    if logits_spec.shape[1] == 1:
        raise PassError("last_token_logits: the program already returns last-token logits")
    gm = program.graph_module
    head = lm_head(gm, output_node_for(gm, program.output_names, LOGITS), HEADS)
    if head is None:
        raise PassError("last_token_logits: no linear layer produces the logits")
    hidden = head.args[0]
    graph = gm.graph
    paged = program.kv_layout is KVLayout.PAGED
    with graph.inserting_before(head):
        input_lens = placeholder(gm, INPUT_LENS)
        if paged:  # tokens packed in one row: sequence s ends at cumsum(input_lens)[s] - 1
            ends = graph.call_function(aten.cumsum.default, (input_lens, 0))
            last = graph.call_function(aten.sub.Tensor, (ends, 1))
            rows = graph.call_function(aten.index_select.default, (hidden, 1, last))  # [1, seqs, hidden]
            gathered = graph.call_function(aten.transpose.int, (rows, 0, 1))  # [seqs, 1, hidden]
        else:
            last = graph.call_function(aten.sub.Tensor, (input_lens, 1))
            index = graph.call_function(aten.view.default, (last, [-1, 1, 1]))
            index = graph.call_function(aten.expand.default, (index, [-1, 1, program.spec.hidden_size]))
            gathered = graph.call_function(aten.gather.default, (hidden, 1, index))
    head.replace_input_with(hidden, gathered)
    finish(gm)
    rows = "seqs" if paged else "batch"
    outputs = [TensorSpec(t.name, t.dtype, (rows, 1, *t.shape[2:])) if t.name == LOGITS else t for t in program.outputs]
    return program.with_signature(program.inputs, outputs), {"rewritten": 1}


register_pass(
    Pass(
        name="last_token_logits",
        summary="LM head on each sequence's last new token only (one row per sequence in prefill)",
        explain=(
            "Finds the linear (or qlinear) that produces the logits, through any single-input ops after it, "
            "and feeds it hidden[b, input_lens[b] - 1] (a gather) instead of every position: logits become "
            "[batch, 1, vocab] (a paged program: each sequence's last packed token, [seqs, 1, vocab]). Needs "
            "kv_cache first. Perplexity needs every position's logits: leave it out."
        ),
        run=last_token_logits,
    )
)
