"""embed: a model that embeds text instead of continuing it. The LM head (and anything after it) goes; the step's
output rows are the final norm's hidden states, [batch, tokens, hidden], which the runtime pools into one
normalized vector a text (option pooling: `last`, the last token's, as Qwen3-Embedding-style decoder embedders
take it, or `mean`, over every token). The pooling is recorded in the artifact's pipeline, where the runtime reads it.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import PassError
from ..ir.program import LOGITS, Program, TensorSpec
from .graph_utils import finish, lm_head, output_node_for
from .registry import Pass, Tensors, Verification, register_pass

aten = torch.ops.aten
POOLINGS = ("last", "mean")


def _head(program: Program) -> torch.fx.Node:
    """The linear that produces the logits (found through a softcap or cast after it)."""
    gm = program.graph_module
    head = lm_head(gm, output_node_for(gm, program.output_names, LOGITS), {aten.linear.default})
    if head is None:
        raise PassError("embed: no linear layer produces the logits (run it first, on the captured graph)")
    return head


def embed(program: Program, pooling: str = "last") -> tuple[Program, dict[str, Any]]:
    if pooling not in POOLINGS:
        raise PassError(f"embed: pooling {pooling!r}: expected one of {', '.join(POOLINGS)}")
    if program.outputs[program.output_names.index(LOGITS)].shape[-1] != program.spec.vocab_size:
        raise PassError("embed: the program returns hidden states already")
    gm = program.graph_module
    head = _head(program)
    hidden = head.args[0]
    output = gm.graph.output_node()
    index = program.output_names.index(LOGITS)
    returned = list(output.args[0])
    returned[index] = hidden
    output.args = (tuple(returned),)
    finish(gm)
    outputs = [
        TensorSpec(t.name, t.dtype, (*t.shape[:-1], program.spec.hidden_size)) if t.name == LOGITS else t
        for t in program.outputs
    ]
    return program.with_signature(program.inputs, outputs), {"pooling": pooling, "width": program.spec.hidden_size}


def _hidden_reference(program: Program, inputs: Tensors, options: dict[str, Any]) -> Tensors:
    """The program before the pass, run by an FX interpreter that returns the LM head's input as its output: what
    the pass should leave, for --verify."""
    head = _head(program)

    class Hidden(torch.fx.Interpreter):
        def run_node(self, node: torch.fx.Node) -> Any:
            value = super().run_node(node)
            if node.op == "output":
                index = program.output_names.index(LOGITS)
                value = (*value[:index], self.env[head.args[0]], *value[index + 1 :])
            return value

    with torch.no_grad():
        results = Hidden(program.graph_module, garbage_collect_values=False).run(
            *(inputs[n] for n in program.input_names)
        )
    return dict(zip(program.output_names, results, strict=True))


register_pass(
    Pass(
        name="embed",
        summary="hidden states instead of logits: a text-embedding model (option pooling: last or mean)",
        explain=(
            "Removes the LM head and what follows it (a softcap, a cast): the step's output, still named logits "
            "in the step interface, becomes the final norm's hidden states [batch, tokens, hidden]. The runtime "
            "pools a prompt's rows into one L2-normalized vector: the last token's (pooling last, the default; "
            "last_token_logits then computes that row alone) or the mean over every token (pooling mean: the "
            "runtime asks for every row). Run it first, on the captured graph. --verify compares with the "
            "program before the pass, run to the LM head's input."
        ),
        run=embed,
        verification=Verification(reference=_hidden_reference),
    )
)
