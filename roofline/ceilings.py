"""Machine ceilings for the roofline: peak matmul throughput per precision and memory bandwidth, measured on
this machine (CPU, or the local GPU) and cached, or a datasheet GPU selected by name."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..errors import LlmlowerError
from ..frontend.example import cache_dir
from ..progress import stage

T = 1e12

# NVIDIA datasheets, dense (without structured sparsity; the datasheets' headline tensor figures are twice
# these), fp16 = FP16 Tensor Core, fp32 = FP32 (non-tensor), int8 = INT8 Tensor Core, bandwidth = GPU memory:
#   A100 80GB SXM  (NVIDIA A100 Tensor Core GPU datasheet): 312 / 19.5 / 624 TFLOPS, HBM2e 2,039 GB/s
#   H100 SXM       (NVIDIA H100 Tensor Core GPU datasheet): 989.5 / 67 / 1,979, HBM3 3.35 TB/s
#   H200 SXM       (NVIDIA H200 Tensor Core GPU datasheet): 989.5 / 67 / 1,979, HBM3e 4.8 TB/s
#   L4             (NVIDIA L4 Tensor Core GPU datasheet):   121 / 30.3 / 242.5, GDDR6 300 GB/s
#   RTX 4090       (NVIDIA Ada Lovelace architecture whitepaper, appendix): 165.2 (FP32 accumulate; 330.3 with
#                  FP16 accumulate) / 82.6 / 660.6, GDDR6X 1,008 GB/s
DATASHEETS: dict[str, dict[str, float]] = {
    "a100": {"fp16": 312 * T, "fp32": 19.5 * T, "int8": 624 * T, "bandwidth": 2.039 * T},
    "h100": {"fp16": 989.5 * T, "fp32": 67 * T, "int8": 1979 * T, "bandwidth": 3.35 * T},
    "h200": {"fp16": 989.5 * T, "fp32": 67 * T, "int8": 1979 * T, "bandwidth": 4.8 * T},
    "l4": {"fp16": 121 * T, "fp32": 30.3 * T, "int8": 242.5 * T, "bandwidth": 0.3 * T},
    "rtx4090": {"fp16": 165.2 * T, "fp32": 82.6 * T, "int8": 660.6 * T, "bandwidth": 1.008 * T},
}
MEASURED = ("cpu", "cuda")
MACHINES = (*MEASURED, *DATASHEETS)
PRECISION_OF_DTYPE = {"float32": "fp32", "float16": "fp16", "bfloat16": "fp16"}


@dataclass(frozen=True)
class Ceilings:
    """Peak matmul operations per second by precision (fp32, fp16, int8; a precision the machine lacks is
    absent) and memory bandwidth in bytes per second (read + write of a large copy)."""

    machine: str
    description: str
    source: str
    flops: dict[str, float]
    bandwidth: float

    @property
    def measured(self) -> bool:
        return self.source == "measured"

    def peak(self, dtype: str) -> float:
        """The compute roof for a model computing in `dtype`."""
        precision = PRECISION_OF_DTYPE[dtype]
        if precision not in self.flops:
            raise LlmlowerError(f"--machine {self.machine}: no {precision} ceiling for a {dtype} model")
        return self.flops[precision]

    def ridge(self, dtype: str) -> float:
        """Arithmetic intensity (FLOPs per byte) where the memory roof meets the compute roof."""
        return self.peak(dtype) / self.bandwidth

    def to_dict(self) -> dict:
        return asdict(self)


def _best_seconds(run: Callable[[], None], repeats: int, sync: Callable[[], None]) -> float:
    """Fastest of `repeats` timed runs, after one warm-up."""
    run()
    sync()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        sync()
        best = min(best, time.perf_counter() - started)
    return best


def _matmul_rate(n: int, dtype: torch.dtype, device: str, sync: Callable[[], None]) -> float:
    """Operations per second of an n x n x n matmul (int8 through torch._int_mm, int32 accumulate)."""
    if dtype is torch.int8:
        a = torch.randint(-128, 127, (n, n), dtype=dtype, device=device)
        b = torch.randint(-128, 127, (n, n), dtype=dtype, device=device)
        seconds = _best_seconds(lambda: torch._int_mm(a, b), 5, sync)
    else:
        a, b = torch.randn(n, n, device=device).to(dtype), torch.randn(n, n, device=device).to(dtype)
        seconds = _best_seconds(lambda: torch.mm(a, b), 5, sync)
    return 2 * n**3 / seconds


def _copy_bandwidth(megabytes: int, device: str, sync: Callable[[], None]) -> float:
    """Bytes per second read and written by a copy of `megabytes` MiB (far larger than any cache)."""
    src = torch.ones(megabytes * 2**20 // 4, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / _best_seconds(lambda: dst.copy_(src), 10, sync)


def _cpu_name() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def measure_cpu() -> Ceilings:
    """fp32 matmul (2048^3), int8 matmul (512^3 through torch._int_mm, where this torch build has it on CPU)
    and a 512 MiB copy, with torch's intra-op threads."""
    flops = {"fp32": _matmul_rate(2048, torch.float32, "cpu", lambda: None)}
    with contextlib.suppress(RuntimeError, NotImplementedError):  # no int8 matmul here: the ceiling is absent
        flops["int8"] = _matmul_rate(512, torch.int8, "cpu", lambda: None)
    description = f"{_cpu_name()}, {torch.get_num_threads()} threads" + (
        ", int8 by torch._int_mm" if "int8" in flops else ""
    )
    return Ceilings("cpu", description, "measured", flops, _copy_bandwidth(512, "cpu", lambda: None))


def measure_cuda() -> Ceilings:
    """fp16, fp32 and int8 matmuls (8192^3) and a 2 GiB copy on the current GPU."""
    if not torch.cuda.is_available():
        raise LlmlowerError("--machine cuda: torch sees no GPU here (pick a datasheet machine: a100, h100, ...)")
    sync = torch.cuda.synchronize
    flops = {
        "fp16": _matmul_rate(8192, torch.float16, "cuda", sync),
        "fp32": _matmul_rate(8192, torch.float32, "cuda", sync),
        "int8": _matmul_rate(8192, torch.int8, "cuda", sync),
    }
    return Ceilings("cuda", torch.cuda.get_device_name(), "measured", flops, _copy_bandwidth(2048, "cuda", sync))


def _cache_file(machine: str) -> Path:
    return cache_dir() / "roofline" / f"ceilings-{machine}.json"


def _fingerprint(machine: str) -> str:
    """What a cached measurement must match to be reused: the processor and the thread count."""
    if machine == "cuda":
        return f"{torch.cuda.get_device_name()} / torch {torch.__version__}"
    return f"{_cpu_name()} / {os.cpu_count()} cores / {torch.get_num_threads()} threads / torch {torch.__version__}"


def machine_ceilings(machine: str = "cpu", remeasure: bool = False) -> Ceilings:
    """Ceilings of `machine`: 'cpu' or 'cuda' measured here (cached under the llmlower cache dir until the
    machine changes or `remeasure`), or a datasheet GPU by name."""
    name = machine.lower()
    if name in DATASHEETS:
        sheet = DATASHEETS[name]
        flops = {k: v for k, v in sheet.items() if k != "bandwidth"}
        return Ceilings(name, f"NVIDIA {name.upper()}", "datasheet", flops, sheet["bandwidth"])
    if name not in MEASURED:
        raise LlmlowerError(f"--machine {machine!r}: expected one of {', '.join(MACHINES)}")
    if name == "cuda" and not torch.cuda.is_available():
        raise LlmlowerError("--machine cuda: torch sees no GPU here (pick a datasheet machine: a100, h100, ...)")
    path = _cache_file(name)
    fingerprint = _fingerprint(name)
    if path.is_file() and not remeasure:
        cached = json.loads(path.read_text(encoding="utf-8"))
        if cached.get("fingerprint") == fingerprint:
            return Ceilings(**cached["ceilings"])
    with stage(f"measure the ceilings of {name} (matmul FLOP/s, copy bandwidth)") as shown:
        ceilings = measure_cpu() if name == "cpu" else measure_cuda()
        shown.detail = ", ".join(f"{k} {v / 1e9:.0f} G/s" for k, v in ceilings.flops.items())
        shown.detail += f", {ceilings.bandwidth / 1e9:.1f} GB/s"
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"fingerprint": fingerprint, "ceilings": ceilings.to_dict()}
    path.write_text(json.dumps(record, indent=2), encoding="utf-8")
    return ceilings
