"""lora: adapter slots beside the decoder's linears, so that one artifact serves several LoRA adapters at once.

Every targeted linear y = x W^T gains y += ((x A^T) * mask) B^T, where A [slots * rank, in] and B
[out, slots * rank] are step inputs holding every slot's adapter side by side (the runtime writes an adapter's A and
its scaled B into its slot's rows and columns, zeros elsewhere), and mask [.., slots * rank] is 1 on the columns of
the slot each token's `lora_slots` entry names (-1, no slot: the base model). Tokens of different adapters share
one step, as a batched LoRA kernel would run them, with two plain linears. Run it on the captured graph, before
fusion and quantization: the base weights are then fused and quantized as without it, the adapters stay float32.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import PassError
from ..ir.program import INPUT_IDS, Program, TensorSpec, fetch_attr
from ..step_io import LORA_SLOTS, lora_module, lora_names
from .graph_utils import add_input, decoder_layer, finish
from .patterns import is_constant
from .registry import Pass, Tensors, Verification, register_pass

aten = torch.ops.aten


def _targets(program: Program, targets: list[str] | None) -> list[tuple[torch.fx.Node, str]]:
    """The decoder layers' linears with constant weights, and their module paths; `targets` keeps those whose
    last path part it names (q_proj, down_proj, ...), None every one."""
    found = []
    for node in program.graph_module.graph.nodes:
        if node.op != "call_function" or node.target is not aten.linear.default or not is_constant(node.args[1]):
            continue
        module = node.args[1].target.removesuffix(".weight")
        if decoder_layer(node) is None or module == node.args[1].target:
            continue
        if targets is None or module.rsplit(".", 1)[-1] in targets:
            found.append((node, module))
    return found


def lora(program: Program, rank: int = 8, max_loras: int = 4, targets: list[str] | None = None) -> tuple[Program, dict]:
    for option, value in (("rank", rank), ("max_loras", max_loras)):
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 256:
            raise PassError(f"lora: {option} {value!r}: expected an integer from 1 to 256")
    if LORA_SLOTS in program.input_names:
        raise PassError("lora: the program has adapter slots already")
    linears = _targets(program, targets)
    if not linears:
        wanted = "linears in its decoder layers" if targets is None else f"linears named {', '.join(targets)}"
        raise PassError(f"lora: the program has no {wanted} (run it first, on the captured graph)")
    gm = program.graph_module
    graph = gm.graph
    slots = add_input(graph, LORA_SLOTS)
    added = [TensorSpec(LORA_SLOTS, "int64", program.inputs[program.input_names.index(INPUT_IDS)].shape)]
    width = max_loras * rank
    gm.register_buffer("lora_column_slots", torch.arange(width, dtype=torch.int64) // rank)
    with graph.inserting_before(linears[0][0]):
        columns = graph.get_attr("lora_column_slots")
        token_slots = graph.call_function(aten.unsqueeze.default, (slots, -1))
        chosen = graph.call_function(aten.eq.Tensor, (token_slots, columns))
        mask = graph.call_function(aten._to_copy.default, (chosen,), {"dtype": torch.float32})
    for linear, module in linears:
        weight = fetch_attr(gm, linear.args[1].target)
        if weight.dtype != torch.float32:
            raise PassError(f"lora: {module}'s weight is {weight.dtype}: adapter slots need a float32 model")
        name_a, name_b = lora_names(module)
        input_a, input_b = add_input(graph, name_a), add_input(graph, name_b)
        added += [
            TensorSpec(name_a, "float32", (width, weight.shape[1])),
            TensorSpec(name_b, "float32", (weight.shape[0], width)),
        ]
        with graph.inserting_before(linear.next):  # linears (x W^T) as the base's: the backends' matmul layout
            down = graph.call_function(aten.linear.default, (linear.args[0], input_a))
            masked = graph.call_function(aten.mul.Tensor, (down, mask))
            up = graph.call_function(aten.linear.default, (masked, input_b))
            total = graph.call_function(aten.add.Tensor, (linear, up))
        linear.replace_all_uses_with(total, delete_user_cb=lambda user, keep=total: user is not keep)
    finish(gm)
    rewritten = program.with_signature(program.inputs + added, program.outputs)
    return rewritten, {"targets": len(linears), "rank": rank, "max_loras": max_loras}


def lora_sum(linear: torch.fx.Node) -> torch.fx.Node | None:
    """The node adding a linear's adapter slots to its output (the lora pass's add), None for a linear without."""
    total = next(iter(linear.users)) if len(linear.users) == 1 else None
    if total is None or total.target is not aten.add.Tensor or total.args[0] is not linear:
        return None
    up = total.args[1]
    adapted = isinstance(up, torch.fx.Node) and up.target is aten.linear.default and up.args[1].op == "placeholder"
    return total if adapted and lora_module(up.args[1].target) is not None else None


def adapter_path(delta: torch.fx.Node) -> list[torch.fx.Node]:
    """The lora pass's nodes computing one linear's adapter output `delta`, in order: x A^T, the mask, B^T."""
    masked = delta.args[0]
    return [masked.args[0], masked, delta]


def _run_base(program: Program, inputs: Tensors, options: dict[str, Any]) -> Tensors:
    """The program after the pass with every token on no slot and random adapters in every slot: the base model's
    outputs, exactly, for --verify."""
    gen = torch.Generator().manual_seed(0)
    extra: Tensors = {LORA_SLOTS: torch.full_like(inputs[INPUT_IDS], -1)}
    for spec in program.inputs:
        if spec.name not in inputs and spec.name != LORA_SLOTS:
            extra[spec.name] = torch.randn(spec.shape, generator=gen)
    return program(**inputs, **extra)


register_pass(
    Pass(
        name="lora",
        summary="LoRA adapter slots beside the decoder's linears (options rank, max_loras, targets)",
        explain=(
            "Adds to every linear of the decoder layers (or those whose last module name is in targets: q_proj, "
            "v_proj, ...) a low-rank path ((x A^T) * mask) B^T over max_loras adapter slots of up to `rank` each: "
            "inputs lora_a__<module> [max_loras * rank, in] and lora_b__<module> [out, max_loras * rank] hold the "
            "slots' weights, lora_slots (shaped as input_ids) names each token's slot (-1: none). The runtime loads "
            "PEFT adapters into the slots; a step mixes tokens of several adapters and of the base model. Run it "
            "first, on the captured float32 graph. --verify runs the program with no token on a slot and random "
            "adapters in every slot against the program before the pass."
        ),
        run=lora,
        verification=Verification(run=_run_base),
    )
)
