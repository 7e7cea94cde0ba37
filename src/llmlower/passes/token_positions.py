"""Token positions that a model computes as arange(tokens), made the step's real positions, for kv_cache.

The capture runs a prompt from position 0 with no cache, so a model that counts its tokens itself
(`arange(tokens) + cache.get_seq_length()`, Llama 4's attention temperature on its NoPE layers) is captured as
arange(tokens): right for that prompt, wrong for every step with a past. Once the cache exists, each such arange
becomes the step's position_ids, [batch, tokens] where the arange had [tokens]: the elementwise ops after it
broadcast the same, and the reshape that put its tokens second ([1, tokens, 1, ...]) now puts batch first.
Any other use is refused by name: lowering it unchanged would compile a model that is right only for prompts."""

from __future__ import annotations

import torch
import torch.fx

from ..errors import PassError
from ..step_io import INPUT_IDS, POSITION_IDS
from .graph_utils import RESHAPES, placeholder, tensor_meta

aten = torch.ops.aten
_ARANGES = {aten.arange.default, aten.arange.start, aten.arange.start_step}


def positions_from_arange(gm: torch.fx.GraphModule) -> int:
    """Replace every live arange over the tokens with position_ids (module docstring); how many were."""
    graph = gm.graph
    ids, positions = placeholder(gm, INPUT_IDS), placeholder(gm, POSITION_IDS)
    tokens = tensor_meta(ids).shape[1]
    live = _outputs_depend_on(graph)  # not what only export's shape asserts read (a mask left before canonicalize)
    rewritten = 0
    for node in list(graph.nodes):
        if not (node in live and node.target in _ARANGES and _counts(node, tokens)):
            continue
        with graph.inserting_before(node):
            batch = graph.call_function(aten.sym_size.int, (positions, 0))
        _rebatch(node, tokens, batch, live)
        node.replace_all_uses_with(positions, delete_user_cb=lambda user: user in live)
        rewritten += 1
    return rewritten


def _counts(node: torch.fx.Node, tokens: torch.SymInt) -> bool:
    """True for arange(tokens) (or arange(0, tokens, 1)): 0, 1, .. over the step's tokens."""
    meta = tensor_meta(node)
    start, step = (node.args[0], node.args[2] if len(node.args) > 2 else 1) if len(node.args) > 1 else (0, 1)
    return meta is not None and meta.dim() == 1 and str(meta.shape[0]) == str(tokens) and (start, step) == (0, 1)


def _outputs_depend_on(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """The nodes the graph's outputs are computed from."""
    live, frontier = set(), [graph.output_node()]
    while frontier:
        node = frontier.pop()
        if node not in live:
            live.add(node)
            frontier += node.all_input_nodes
    return live


def _rebatch(arange: torch.fx.Node, tokens: torch.SymInt, batch: torch.fx.Node, live: set[torch.fx.Node]) -> None:
    """Check every use downstream of `arange` that the outputs depend on is elementwise up to a reshape to [1,
    tokens, ...], and make that reshape's leading 1 the batch."""
    frontier = [user for user in arange.users if user in live]
    while frontier:
        node = frontier.pop()
        meta = tensor_meta(node)
        if meta is not None and meta.dim() == 1 and str(meta.shape[0]) == str(tokens):
            frontier += [user for user in node.users if user in live]  # still [tokens]: an elementwise op
            continue
        shape = node.args[1] if node.target in RESHAPES else None
        if shape is None or len(shape) < 2 or shape[0] != 1 or str(_size(shape[1])) != str(tokens):
            raise PassError(
                f"kv_cache: {node.name} ({node.target}) computes from the tokens' positions as arange(tokens), "
                "which holds only for a prompt with no past; only elementwise ops and a reshape to [1, tokens, ..] "
                "are rewritten to the step's positions"
            )
        node.args = (node.args[0], [batch, *shape[1:]], *node.args[2:])


def _size(value: object) -> object:
    """A reshape's dimension as a value: a SymInt node's recorded value, or the int itself."""
    return value.meta.get("val") if isinstance(value, torch.fx.Node) else value
