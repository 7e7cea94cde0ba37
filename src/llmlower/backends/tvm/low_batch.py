"""Matmuls over a dynamic number of rows on CUDA: one kernel function with a low-batch GEMV schedule for the few
rows of a decode step and DLight's matmul schedule for the many of a prefill, chosen by the row count at run time.

DLight's matmul tiles rows by 32 and columns by 64, so a decode step's down projection (2,048 columns, 8,192
deep) runs as 32 thread blocks walking the whole depth, a few percent of the memory bandwidth; its GEMV rules
need a fixed row count. Here each matmul whose only dynamic dimension is its rows gets, besides the matmul
schedule, DLight's low-batch GEMV schedule for each bucket of LOW_BATCH_BUCKETS (rows padded to the bucket,
the depth split across a block's threads), dispatched by `rows <= limit`.
"""

from __future__ import annotations

import tvm
from tvm import s_tir, tirx
from tvm.s_tir import dlight

LOW_BATCH_BUCKETS = ((2, 2), (8, 4), (64, 8))  # (at most this many rows, rows each GEMV pass reads the weights for)


class SimtMatmul(dlight.gpu.Matmul):
    """DLight's GPU matmul on CUDA cores: TVM 0.27's tensor-core path segfaults in Tensorize on SmolLM2's float16
    matmuls (sm_80, sm_90). DLight tries that path on sm_70 and newer, importing its tensor-core intrinsics (a
    minute or more of TVMScript parsing) before it reads `dlight.do_not_tensorize`; so the rule schedules for
    the target as if it were sm_60, whose CUDA-core schedule is the same for every arch."""

    def apply(self, func: tirx.PrimFunc, target: tvm.target.Target, tunable: bool) -> s_tir.Schedule | None:
        if isinstance(func, tirx.PrimFunc):
            func = func.with_attr("dlight.do_not_tensorize", True)
        return super().apply(func, _without_tensor_cores(target), tunable)


def _without_tensor_cores(target: tvm.target.Target) -> tvm.target.Target:
    """`target` with its CUDA arch below sm_70, where DLight's matmul never considers tensor cores."""
    if target.kind.name != "cuda":
        return target
    return tvm.target.Target({**target.export(), "arch": "sm_60"})


def _scheduled(rule: dlight.ScheduleRule, func: tirx.PrimFunc, target: tvm.target.Target) -> tirx.PrimFunc | None:
    schedule = rule.apply(func, target, False)
    return None if schedule is None else schedule.mod["main"]


def _row_var(func: tirx.PrimFunc) -> tirx.Var | None:
    """The function's one dynamic dimension (a matmul's rows), or None if it has none or several."""
    dims = {d for param in func.params for d in getattr(param, "shape", ()) if isinstance(d, tirx.Var)}
    return dims.pop() if len(dims) == 1 else None


def dispatch_low_batch(func: tirx.PrimFunc, target: tvm.target.Target) -> tirx.PrimFunc | None:
    """`func` scheduled as a GEMV per low-batch bucket and as a matmul beyond them, or None where it is not a
    matmul over dynamic rows."""
    rows = _row_var(func)
    if rows is None:
        return None
    gemvs = []
    for limit, bucket in LOW_BATCH_BUCKETS:  # most such functions are elementwise: refused by the first bucket
        gemv = _scheduled(dlight.gpu.LowBatchGEMV(bucket), func, target)
        if gemv is None:
            return None
        gemvs.append((limit, gemv))
    matmul = _scheduled(SimtMatmul(), func, target)
    if matmul is None:
        return None
    body = matmul.body
    for limit, gemv in reversed(gemvs):
        body = tirx.IfThenElse(tirx.op.tvm_thread_invariant(rows <= limit), gemv.body, body)
    root = s_tir.SBlockRealize([], True, s_tir.SBlock([], [], [], "root", body))
    return (
        func.with_body(root).with_attr("tirx.is_scheduled", True).with_attr("tirx.HoistIfThenElseExprWithBlock", True)
    )


@tvm.transform.module_pass(opt_level=0, name="LowBatchDispatch")
def low_batch_dispatch(module: tvm.IRModule, _context: tvm.transform.PassContext) -> tvm.IRModule:
    """Every unscheduled matmul over dynamic rows dispatched between its GEMV buckets and its matmul schedule
    (the target is the current one)."""
    target = tvm.target.Target.current(allow_none=False)
    for name, func in module.functions_items():
        if isinstance(func, tirx.PrimFunc) and not func.attrs.get("tirx.is_scheduled", False):
            dispatched = dispatch_low_batch(func, target)
            if dispatched is not None:
                module.update_func(name, dispatched)
    return module
