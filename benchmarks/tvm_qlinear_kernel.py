"""TVM's quantized linear kernel alone: one `qlinear` (made-up weights) through the TVM backend's converters and CPU
pipeline, timed per call for each row count; for one row, the weight's bytes over the time, against a copy's
bandwidth (read + written). The default shapes are SmolLM2's: q/k/v fused (576 -> 960), gate/up fused (576 ->
3072), down (1536 -> 576) and the LM head (576 -> 49152).

    .venv/bin/python benchmarks/tvm_qlinear_kernel.py [--shapes 576x3072,1536x576] [--quant q4g32-sym,q4g32-sym-f16]
        [--rows 1,16,128] [--accuracy-levels 0,4] [--repeats 20] [--threads 2] [--cpu rocketlake]
"""

from __future__ import annotations

import argparse

import torch
import tvm
from kernel_timing import add_run_arguments, compiled, seconds_per_call, start

from llmlower.ir.qlinear import QLINEAR
from llmlower.ir.quant import QuantScheme, quantize
from llmlower.passes.pipelines import parse_quant

SHAPES = "576x960,576x3072,1536x576,576x49152"


class Linear(torch.nn.Module):
    """The op over x and the weight's tensors, all passed in (no parameters)."""

    def __init__(self, bits: int, in_features: int, zeros: bool) -> None:
        super().__init__()
        self.bits, self.in_features, self.zeros = bits, in_features, zeros

    def forward(self, x, qweight, scales, *zeros):
        return QLINEAR.op(x, qweight, scales, zeros[0] if self.zeros else None, None, self.bits, self.in_features)


def packed(in_features: int, out_features: int, quant: str) -> tuple[list[torch.Tensor], int]:
    """A seeded random weight [out, in] quantized by the scheme (a name ending in -f16: float16 scales): its tensors
    and bits."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=gen) * 0.02
    options = parse_quant(quant.removesuffix("-f16"))
    if options is None or "overrides" in options:
        raise SystemExit(f"--quant {quant}: this benchmark takes one scheme (q8, q4g32, q4g32-sym-f16, ...)")
    scheme = QuantScheme(**options, scale_dtype="float16" if quant.endswith("-f16") else None)
    q = quantize(weight, scheme)
    return [t for t in (q.qweight, q.scales, q.zeros) if t is not None], scheme.bits


def compiled_linear(
    module: Linear, tensors: list[torch.Tensor], accuracy_level: int, cpu: str | None
) -> tvm.relax.VirtualMachine:
    """The module exported for any number of rows, compiled for this CPU (or LLVM's CPU `cpu`)."""
    rows = torch.export.Dim("rows", min=1, max=4096)
    example = (torch.randn(2, module.in_features), *tensors)
    shapes = ({0: rows}, None, None, *([(None,)] if len(tensors) == 3 else []))  # the last: *zeros
    return compiled(module, example, shapes, accuracy_level, cpu)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=SHAPES, help="comma-separated IN x OUT")
    parser.add_argument("--quant", default="q4g32-sym,q4g32-zp4,q4g32,q8")
    parser.add_argument("--rows", default="1,16,128")
    parser.add_argument(
        "--accuracy-levels", default="0,4", help="the backend's accuracy_level (4: grouped matmuls in int8)"
    )
    add_run_arguments(parser)
    args = parser.parse_args()
    bandwidth = start(args)
    for shape in args.shapes.split(","):
        in_features, out_features = (int(n) for n in shape.split("x"))
        for quant in args.quant.split(","):
            tensors, bits = packed(in_features, out_features, quant)
            module = Linear(bits, in_features, len(tensors) == 3)
            weights = [tvm.runtime.tensor(t.numpy()) for t in tensors]
            nbytes = sum(t.numel() * t.element_size() for t in tensors)
            for level in (int(n) for n in args.accuracy_levels.split(",")):
                vm = compiled_linear(module, tensors, level, args.cpu)
                for rows in (int(n) for n in args.rows.split(",")):
                    gen = torch.Generator().manual_seed(rows)
                    xs = [torch.randn(rows, in_features, generator=gen) for _ in range(args.repeats)]
                    calls = [[tvm.runtime.tensor(x.numpy()), *weights] for x in xs]
                    seconds = seconds_per_call(vm, calls)
                    expected = module(xs[0], *tensors)
                    error = (
                        torch.from_numpy(vm["main"](*calls[0]).numpy()) - expected
                    ).abs().max() / expected.abs().max()
                    flops = 2 * rows * in_features * out_features / seconds
                    line = (
                        f"{shape:>10} {quant:>10} level {level} rows {rows:>4}: {seconds * 1e3:8.3f} ms, "
                        f"{flops / 1e9:6.1f} GFLOP/s, error {error:.1e} of max |out|"
                    )
                    if rows == 1:
                        rate = nbytes / seconds
                        line += f", {rate / 1e9:.1f} GB/s of weights ({100 * rate / bandwidth:.0f}% of the copy's)"
                    print(line, flush=True)


if __name__ == "__main__":
    main()
