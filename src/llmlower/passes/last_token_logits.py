"""last_token_logits: run the LM head only on the tokens whose next token is sampled.

A prefill of a 500-token prompt then multiplies one row by the [vocab, hidden] LM head instead of 500 (an
embedding program, the embed pass's, returns those rows of its hidden states). Which rows is a step input
(`logits_indices`, see step_io): each sequence's last new token in a plain step, its last k + 1 when speculative
decoding verifies k proposed tokens.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import PassError
from ..ir.program import LOGITS, Program, TensorSpec
from ..ir.qlinear import QLINEAR
from ..step_io import LOGITS_INDICES
from .graph_utils import finish, lm_head, output_node_for
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
    output = output_node_for(gm, program.output_names, LOGITS)
    embedding = "embed" in {record.name for record in program.history}
    head = None if embedding else lm_head(gm, output, HEADS)
    if head is None and not embedding:
        raise PassError("last_token_logits: no linear layer produces the logits")
    hidden = output if embedding else head.args[0]  # an embedding program's rows are the hidden states themselves
    graph = gm.graph
    with graph.inserting_after(list(graph.find_nodes(op="placeholder"))[-1]):  # the signature's last input
        indices = graph.placeholder(LOGITS_INDICES)
    with graph.inserting_after(hidden):  # hidden [rows, tokens, h] -> [rows * tokens, h] -> the indexed rows
        flat = graph.call_function(aten.reshape.default, (hidden, [-1, program.spec.hidden_size]))
    with graph.inserting_after(flat):
        rows = graph.call_function(aten.index_select.default, (flat, 0, indices))
    with graph.inserting_after(rows):
        gathered = graph.call_function(aten.unsqueeze.default, (rows, 1))  # [logits, 1, hidden]
    if embedding:
        graph.output_node().replace_input_with(hidden, gathered)
    else:
        head.replace_input_with(hidden, gathered)
    finish(gm)
    inputs = [*program.inputs, TensorSpec(LOGITS_INDICES, "int64", ("logits",))]
    outputs = [
        TensorSpec(t.name, t.dtype, ("logits", 1, *t.shape[2:])) if t.name == LOGITS else t for t in program.outputs
    ]
    return program.with_signature(inputs, outputs), {"rewritten": 1}


register_pass(
    Pass(
        name="last_token_logits",
        summary="LM head only on the tokens that are sampled (one row per sequence in prefill)",
        explain=(
            "Finds the linear (or qlinear) that produces the logits, through any single-input ops after it, "
            "and feeds it the rows of hidden (flattened to [rows * tokens, hidden]) named by a new input, "
            "logits_indices, instead of every position: logits become [logits, 1, vocab]. The runtime names "
            "each sequence's last token, or its last k + 1 when verifying k speculative tokens. Needs kv_cache "
            "first. Perplexity needs every position's logits: leave it out."
        ),
        run=last_token_logits,
    )
)
