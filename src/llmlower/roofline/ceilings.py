"""Machine ceilings for the roofline: peak matmul throughput per precision and memory bandwidth, measured on
this machine (CPU, or the local GPU) and cached, or a datasheet GPU selected by name."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import LlmlowerError
from ..frontend.example import cache_dir
from ..ir.quant import QuantScheme, quantize
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


# How the ceilings are measured; a cached measurement made another way (torch._int_mm for int8, single trials)
# is measured again.
METHOD = "v2: int8 = onnxruntime MatMulNBits accuracy_level 4; best of 5 trials, each a median of 3 runs"
TRIALS, RUNS = 5, 3
NBITS_GROUP = 32  # the int8 probes' quantization group: q4g32's and q8's


@dataclass(frozen=True)
class Probe:
    """One ceiling's benchmark: `run` does `work` operations (or moves `work` bytes) each call."""

    work: float
    run: Callable[[], Any]


def best_rates(
    probes: dict[str, Probe], sync: Callable[[], None], trials: int = TRIALS, runs: int = RUNS
) -> dict[str, float]:
    """Work per second of each probe: the best of `trials` trials, each the median of `runs` timed runs (after
    one warm-up). The trials take the probes in turn, so a busy moment of a shared machine lowers one trial of
    each probe rather than every trial of one."""
    for probe in probes.values():
        probe.run()
    sync()
    best = dict.fromkeys(probes, 0.0)
    for _ in range(trials):
        for name, probe in probes.items():
            seconds = []
            for _ in range(runs):
                started = time.perf_counter()
                probe.run()
                sync()
                seconds.append(time.perf_counter() - started)
            best[name] = max(best[name], probe.work / statistics.median(seconds))
    return best


def torch_matmul_probe(n: int, dtype: torch.dtype, device: str) -> Probe:
    """An n x n x n matmul in `dtype` (int8 through torch._int_mm, int32 accumulate: cuBLAS on a GPU)."""
    if dtype is torch.int8:
        a = torch.randint(-128, 127, (n, n), dtype=dtype, device=device)
        b = torch.randint(-128, 127, (n, n), dtype=dtype, device=device)
        return Probe(2 * n**3, lambda: torch._int_mm(a, b))
    a, b = torch.randn(n, n, device=device).to(dtype), torch.randn(n, n, device=device).to(dtype)
    return Probe(2 * n**3, lambda: torch.mm(a, b))


def copy_probe(megabytes: int, device: str) -> Probe:
    """A copy of `megabytes` MiB (far larger than any cache): its bytes read plus written."""
    src = torch.ones(megabytes * 2**20 // 4, device=device)
    dst = torch.empty_like(src)
    return Probe(2 * src.numel() * 4, lambda: dst.copy_(src))


def matmul_nbits_model(rows: int, k: int, n: int, bits: int) -> bytes:
    """An ONNX model of one com.microsoft MatMulNBits, x [rows, k] float32 times a random [n, k] weight
    quantized to `bits` (group 32, symmetric) at accuracy_level 4: the attributes and packed layout the onnx
    backend emits for qlinear, built from the quantize pass's own packing."""
    from onnx import TensorProto, helper, numpy_helper

    from ..backends.onnx.export import MAX_IR_VERSION

    scheme = QuantScheme(bits, NBITS_GROUP)
    packed = quantize(torch.randn(n, k), scheme)
    weights = [
        numpy_helper.from_array(packed.qweight.numpy(), "qweight"),
        numpy_helper.from_array(packed.scales.reshape(-1).numpy(), "scales"),
    ]
    node = helper.make_node(
        "MatMulNBits",
        ["x", "qweight", "scales"],
        ["y"],
        domain="com.microsoft",
        K=k,
        N=n,
        bits=bits,
        block_size=scheme.group,
        accuracy_level=4,
    )
    graph = helper.make_graph(
        [node],
        "matmul_nbits",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [rows, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [rows, n])],
        weights,
    )
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets, ir_version=MAX_IR_VERSION)
    return model.SerializeToString()


def matmul_nbits_probe(rows: int, k: int, n: int, bits: int) -> Probe:
    """ONNX Runtime's CPU MatMulNBits at accuracy_level 4 (MLAS quantizes x to int8 and multiplies in int8,
    what the q4/q8 ONNX artifacts run), one intra-op thread per logical core as the executors run."""
    import onnxruntime as ort

    from ..runtime.executors.onnx import session_options

    session = ort.InferenceSession(
        matmul_nbits_model(rows, k, n, bits),
        session_options(threads=os.cpu_count() or 0),
        providers=["CPUExecutionProvider"],
    )
    x = {"x": np.random.default_rng(0).standard_normal((rows, k), dtype=np.float32)}
    return Probe(2 * rows * k * n, lambda: session.run(None, x))


def int8_matmul_rate(rows: int, k: int, n: int, bits: int = 4, trials: int = TRIALS, runs: int = RUNS) -> float:
    """int8 operations per second of ONNX Runtime's MatMulNBits on a [rows, k] x [k, n] product."""
    return best_rates({"int8": matmul_nbits_probe(rows, k, n, bits)}, lambda: None, trials, runs)["int8"]


def _cpu_name() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _int8_probes() -> dict[str, Probe]:
    """MatMulNBits [512, 2048] x [2048, 2048] with int4 and with int8 weights (the q4 and q8 pipelines'
    kernels); none where ONNX Runtime is not installed (the int8 ceiling is then absent)."""
    try:
        return {f"int8 w{bits}": matmul_nbits_probe(512, 2048, 2048, bits) for bits in (4, 8)}
    except ImportError:
        return {}


def measure_cpu() -> Ceilings:
    """fp32 matmul (2048^3 torch.mm, torch's intra-op threads), int8 matmul (the faster of ONNX Runtime's
    MatMulNBits with int4 and int8 weights, computing in int8) and a 512 MiB copy."""
    probes = {
        "fp32": torch_matmul_probe(2048, torch.float32, "cpu"),
        "bandwidth": copy_probe(512, "cpu"),
        **_int8_probes(),
    }
    rates = best_rates(probes, lambda: None)
    flops = {"fp32": rates["fp32"]}
    int8 = [rate for name, rate in rates.items() if name.startswith("int8")]
    if int8:
        flops["int8"] = max(int8)
    description = f"{_cpu_name()}, {torch.get_num_threads()} threads" + (
        f", int8 by onnxruntime MatMulNBits on {os.cpu_count()} threads" if int8 else ""
    )
    return Ceilings("cpu", description, "measured", flops, rates["bandwidth"])


def measure_cuda() -> Ceilings:
    """fp16, fp32 and int8 matmuls (8192^3) and a 2 GiB copy on the current GPU."""
    if not torch.cuda.is_available():
        raise LlmlowerError("--machine cuda: torch sees no GPU here (pick a datasheet machine: a100, h100, ...)")
    probes = {
        "fp16": torch_matmul_probe(8192, torch.float16, "cuda"),
        "fp32": torch_matmul_probe(8192, torch.float32, "cuda"),
        "int8": torch_matmul_probe(8192, torch.int8, "cuda"),
        "bandwidth": copy_probe(2048, "cuda"),
    }
    rates = best_rates(probes, torch.cuda.synchronize)
    bandwidth = rates.pop("bandwidth")
    return Ceilings("cuda", torch.cuda.get_device_name(), "measured", rates, bandwidth)


def _cache_file(machine: str) -> Path:
    return cache_dir() / "roofline" / f"ceilings-{machine}.json"


def _onnxruntime_version() -> str:
    try:
        import onnxruntime
    except ImportError:
        return "none"
    return onnxruntime.__version__


def _fingerprint(machine: str) -> str:
    """What a cached measurement must match to be reused: the measurement method, the processor, the thread
    count and the libraries that ran the probes."""
    if machine == "cuda":
        return f"{METHOD} / {torch.cuda.get_device_name()} / torch {torch.__version__}"
    return (
        f"{METHOD} / {_cpu_name()} / {os.cpu_count()} cores / {torch.get_num_threads()} threads / "
        f"torch {torch.__version__} / onnxruntime {_onnxruntime_version()}"
    )


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
