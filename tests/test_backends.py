"""The backends table: what each registered backend declares resolves, and reading the table is cheap."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmlower.backends.registry import BACKENDS
from llmlower.runtime.executors import executor_of


@pytest.mark.parametrize("backend", list(BACKENDS.values()), ids=list(BACKENDS))
def test_what_a_backend_declares_resolves(backend):
    for reference in (backend.compiler, backend.program_executor, backend.check):
        assert reference is None or callable(backend.load(reference))
    for reference in backend.executors.values():
        assert executor_of(Path("artifact"), {"executor": reference}).__name__ == reference.split(":")[1]
    if backend.compiler is not None:  # every target's artifacts have an executor
        assert set(backend.layouts.values()) <= set(backend.executors)
    assert set(backend.kv_cache_dtypes) <= set(backend.targets)


def test_the_table_imports_neither_torch_nor_a_toolkit(without_torch):
    done = without_torch(
        """
        import sys
        from llmlower.backends.registry import BACKENDS
        print(list(BACKENDS), [m for m in ("onnx", "onnxruntime", "tvm", "torch_mlir") if m in sys.modules])
        """
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "['torch', 'onnx', 'tvm', 'mlir'] []"
