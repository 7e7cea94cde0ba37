"""TVM's mixture-of-experts kernel alone: one layer's `moe_experts` / `qmoe_experts` (made-up weights, the router's
ids and weights given) through the TVM backend's converters and CPU pipeline, timed per call for each token count;
for one token, the chosen experts' bytes over the time, against a copy's bandwidth (read + written). Each call routes
to other experts (random ids), so the chosen ones are not already in the cache from the call before.

    .venv/bin/python benchmarks/tvm_moe_kernel.py [--hidden 1024] [--experts 32] [--expert-size 1024] [--top-k 4]
        [--quant q4g32-sym,q4g32-sym-f16,none] [--accuracy-levels 0,4] [--tokens 1,16,128] [--repeats 20]
        [--threads 2] [--cpu rocketlake]
"""

from __future__ import annotations

import argparse

import torch
import tvm
from kernel_timing import add_run_arguments, compiled, seconds_per_call, start
from tvm import relax

from llmlower.ir.moe import MOE_EXPERTS
from llmlower.ir.qmoe import QMOE_EXPERTS
from llmlower.ir.quant import QuantScheme, quantize
from llmlower.passes.pipelines import parse_quant


class Experts(torch.nn.Module):
    """The op over its inputs (x, ids, weights) and the experts' tensors, all passed in (no parameters)."""

    def __init__(self, bits: int | None) -> None:
        super().__init__()
        self.bits = bits

    def forward(self, x, ids, weights, *experts):
        if self.bits is None:
            up, down = experts
            return MOE_EXPERTS.op(x, ids, weights, up, None, down, None)
        up_q, up_s, down_q, down_s = experts
        up, down = (up_q, up_s, None, None, self.bits), (down_q, down_s, None, None, self.bits)
        return QMOE_EXPERTS.op(x, ids, weights, *up, *down)


def expert_tensors(args: argparse.Namespace, quant: str) -> tuple[list[torch.Tensor], int | None]:
    """The experts' up [E, 2I, H] and down [E, H, I] weights, float or packed with scales (no zero points; a name
    ending in -f16: float16 scales)."""
    gen = torch.Generator().manual_seed(0)
    up = torch.randn(args.experts, 2 * args.expert_size, args.hidden, generator=gen) * 0.02
    down = torch.randn(args.experts, args.hidden, args.expert_size, generator=gen) * 0.02
    options = parse_quant(quant.removesuffix("-f16"))
    if options is None:
        return [up, down], None
    scheme = QuantScheme(**options, scale_dtype="float16" if quant.endswith("-f16") else None)
    if not scheme.symmetric:
        raise SystemExit(f"--quant {quant}: this benchmark takes the symmetric schemes (no zero points)")
    packed = [quantize(w, scheme) for w in (up, down)]
    return [t for p in packed for t in (p.qweight, p.scales)], scheme.bits


def compiled_experts(
    module: torch.nn.Module, example: tuple, accuracy_level: int, cpu: str | None
) -> relax.VirtualMachine:
    """The module exported for any number of tokens, compiled at the backend's accuracy_level for this CPU (or LLVM's
    CPU `cpu`)."""
    tokens = torch.export.Dim("tokens", min=1, max=4096)
    shapes = ({0: tokens}, {0: tokens}, {0: tokens}, (None,) * (len(example) - 3))  # the last: *experts
    return compiled(module, example, shapes, accuracy_level, cpu)


def router(tokens: int, args: argparse.Namespace, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [tokens, hidden], distinct expert ids and weights [tokens, top_k]."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, args.hidden, generator=gen)
    ids = torch.stack([torch.randperm(args.experts, generator=gen)[: args.top_k] for _ in range(tokens)])
    return x, ids, torch.rand(tokens, args.top_k, generator=gen)


def chosen_bytes(experts: list[torch.Tensor], top_k: int) -> int:
    """The bytes of top_k experts' tensors: what a one-token call must read."""
    return top_k * sum(t[0].numel() * t[0].element_size() for t in experts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--expert-size", type=int, default=1024)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--quant", default="q4g32-sym,none")
    parser.add_argument("--tokens", default="1,16,128")
    parser.add_argument(
        "--accuracy-levels", default="0,4", help="the backend's accuracy_level (4: the experts' matmuls in int8)"
    )
    add_run_arguments(parser)
    args = parser.parse_args()
    bandwidth = start(args)
    for quant in args.quant.split(","):
        experts, bits = expert_tensors(args, quant)
        weights = [tvm.runtime.tensor(t.numpy()) for t in experts]
        for level in (int(n) for n in args.accuracy_levels.split(",")) if bits else (0,):
            vm = compiled_experts(Experts(bits), (*router(2, args), *experts), level, args.cpu)
            for tokens in (int(n) for n in args.tokens.split(",")):
                routers = [router(tokens, args, seed) for seed in range(args.repeats)]
                calls = [[tvm.runtime.tensor(t.numpy()) for t in inputs] + weights for inputs in routers]
                seconds = seconds_per_call(vm, calls)
                line = f"{quant:>14} level {level} tokens {tokens:>4}: {seconds * 1e3:8.3f} ms"
                if tokens == 1:
                    rate = chosen_bytes(experts, args.top_k) / seconds
                    line += f", {rate / 1e9:.1f} GB/s of chosen experts ({100 * rate / bandwidth:.0f}% of the copy's)"
                print(line, flush=True)


if __name__ == "__main__":
    main()
