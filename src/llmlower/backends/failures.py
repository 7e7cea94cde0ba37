"""The boundary between llmlower and a backend's toolkit (torch.onnx's exporter, TVM, torch-mlir): a build that
fails inside the toolkit with the toolkit's own exception becomes one BackendError line naming the backend and,
where the error's text names an op the program calls, the node and op, instead of a traceback."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

import torch

from ..errors import BackendError, LlmlowerError
from ..ir.program import Program

MAX_DETAIL = 200  # characters of the toolkit's first line kept in the message
MAX_CHAIN = 16  # wrapped errors followed at most
ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")


def error_chain(error: BaseException) -> list[BaseException]:
    """The error and the errors it wraps, outermost first (toolkits re-raise the one naming the op)."""
    chain = [error]
    while (inner := chain[-1].__cause__ or chain[-1].__context__) is not None and len(chain) < MAX_CHAIN:
        chain.append(inner)
    return chain


def first_line(error: BaseException) -> str:
    """The error's type and the first line of its message, without terminal colours, shortened to MAX_DETAIL."""
    lines = ANSI_ESCAPE.sub("", str(error)).strip().splitlines()
    detail = f"{type(error).__name__}: {lines[0] if lines else ''}".strip()
    return detail if len(detail) <= MAX_DETAIL else detail[: MAX_DETAIL - 1] + "…"


def op_names(target: torch._ops.OpOverload) -> tuple[str, str]:
    """How toolkits write an op: its qualified name (transformers.grouped_mm_fallback) or its overload's name
    (histc.default)."""
    return f"{target.namespace}.{target._opname}", target.__name__


def failing_node(program: Program, text: str) -> torch.fx.Node | None:
    """The first node of the program calling an op `text` names; ops outside aten first (a custom op is the
    likelier culprit than an aten op quoted in passing)."""
    calls = [
        node
        for node in program.graph_module.graph.nodes
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload)
    ]
    calls.sort(key=lambda node: node.target.namespace == "aten")
    for node in calls:
        if any(re.search(rf"(?<![\w.]){re.escape(name)}(?![\w])", text) for name in op_names(node.target)):
            return node
    return None


def describe(backend: str, program: Program, error: Exception) -> str:
    """One line: the node and op the toolkit could not lower when its errors name one, and the first line of the
    innermost error (the most specific: the outer ones say which export step failed)."""
    chain = error_chain(error)
    detail = first_line(chain[-1])
    node = failing_node(program, "\n".join(str(e) for e in chain))
    if node is not None:
        return f"the {backend} backend cannot lower node {node.name} (op {node.target}): {detail}"
    return f"the {backend} backend failed to build the artifact: {detail}"


@contextlib.contextmanager
def backend_errors(backend: str, program: Program) -> Iterator[None]:
    """Inside, an exception of a toolkit's (not one of llmlower's errors, which already say what is wrong, nor an
    interrupt) becomes a BackendError described by describe()."""
    try:
        yield
    except LlmlowerError:
        raise
    except Exception as error:
        raise BackendError(describe(backend, program, error)) from error
