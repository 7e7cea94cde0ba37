"""What the TVM kernel benchmarks share: a torch module compiled alone through the TVM backend's converters and CPU
pipeline, calls timed as a median, a copy's bandwidth to compare against, and their --repeats/--threads options."""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import tvm
from tvm import relax

from llmlower.backends.tvm.compile import compile_module, tvm_target
from llmlower.backends.tvm.lowerings import convert_map
from llmlower.backends.tvm.relax_import import StepImporter
from llmlower.roofline.ceilings import copy_probe
from llmlower.runtime.executors.tvm import use_threads


def compiled(
    module: torch.nn.Module, example: tuple, dynamic_shapes: tuple, accuracy_level: int = 0, cpu: str | None = None
) -> relax.VirtualMachine:
    """The module exported with these dynamic shapes, imported by the TVM backend's converters (`accuracy_level`:
    the backend's option), compiled for this CPU or for LLVM's CPU `cpu` (rocketlake: AVX-512 VNNI without AMX;
    x86-64-v3: AVX2)."""
    exported = torch.export.export(module, example, dynamic_shapes=dynamic_shapes).run_decompositions()
    target = tvm_target("cpu", cpu=cpu)
    relax_module = StepImporter(target, accuracy_level).from_exported_program(
        exported, False, True, False, convert_map()
    )
    return relax.VirtualMachine(compile_module(relax_module, target), tvm.cpu())


def seconds_per_call(vm: relax.VirtualMachine, calls: list[list[tvm.runtime.Tensor]]) -> float:
    """The median over the calls' inputs, after a warm-up call with the first."""
    vm["main"](*calls[0])
    times = []
    for inputs in calls:
        start = time.perf_counter()
        vm["main"](*inputs)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def copy_bandwidth(repeats: int) -> float:
    """Bytes read plus written per second by a 512 MiB copy, the median over `repeats`."""
    probe = copy_probe(512, "cpu")
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        probe.run()
        times.append(time.perf_counter() - start)
    return probe.work / statistics.median(times)


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cpu", help="build for this LLVM CPU instead of this one's (it must run here)")


def start(args: argparse.Namespace) -> float:
    """Give TVM the asked threads, measure the copy bandwidth and print both; returns the bandwidth."""
    use_threads(args.threads)
    bandwidth = copy_bandwidth(5)
    print(f"copy bandwidth {bandwidth / 1e9:.1f} GB/s, {args.threads} TVM threads, median of {args.repeats}")
    return bandwidth
