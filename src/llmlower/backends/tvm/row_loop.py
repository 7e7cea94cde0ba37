"""The loop over a CPU kernel's rows (tokens): across the thread pool where there are enough rows to pay for it, on
the calling thread where there are few. A parallel loop wakes the pool's threads and waits for each of them, and a
row of a norm, a gate or a rotation takes a fraction of a microsecond: at decode's one row the launch was most of the
kernel (four such kernels a layer), and running them on the calling thread made SmolLM2's batch-1 decode 3-5% faster
(q4mix-a8, 2 threads, a Sapphire Rapids VM)."""

from __future__ import annotations

from tvm.script import tirx as T

PARALLEL_ROWS = 8  # rows from which the loop runs on the thread pool


@T.macro
def over_rows(rows, row, operands):  # row(i, *operands) for each of `rows` rows; `row` a macro
    if rows >= PARALLEL_ROWS:
        for i in T.parallel(rows):
            row(i, *operands)
    else:
        for i in T.serial(rows):
            row(i, *operands)
