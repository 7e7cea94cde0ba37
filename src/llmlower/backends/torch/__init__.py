"""The torch backend: a Program's graph run eagerly (program_executor.TorchExecutor); the reference every other
backend is checked against. It writes no artifacts."""

from ...step_io import KVLayout
from ..backend import Backend

BACKEND = Backend(
    name="torch",
    package=__name__,
    layouts={"cpu": KVLayout.PAGED},
    program_executor="program_executor:program_executor",
    summary="the reference: the Program's graph run eagerly by torch (no artifact)",
    kv_cache_dtypes={"cpu": ("float16", "bfloat16", "int8")},
    toolkit=("torch",),
)
