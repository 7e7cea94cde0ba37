"""Targets and the Relax build: TVM's own pipeline for the target with DLight schedules added.

cpu -> llvm with the host CPU (`-mcpu`, detected, overridable); cuda -> the CUDA codegen for an architecture
(sm_80, sm_89, sm_90, ...), which builds here without a GPU. On CUDA the DLight GPU rules schedule every
kernel; on CPU the DLight CPU rules schedule the GEMVs and reductions (decode) and the rest keeps TVM's
default loops. Transposed weights are read in place (FuseTransposeMatmul), never transposed per step.

Portable CPU libraries: one built for this machine's CPU (the default) may use instructions another machine
lacks (AVX-512 on one x86 server, not on the next). The manifest records the LLVM triple, the CPU and the
features LLVM enables for it (`cpu_manifest`), and the runtime refuses the artifact on a machine missing one
instead of dying with SIGILL. For a library that runs on every x86 machine of a generation, build for an x86-64
microarchitecture level: `--cpu x86-64-v2` (SSE4.2, POPCNT, CX16: x86 CPUs since about 2009), `--cpu x86-64-v3`
(adds AVX2, FMA, BMI2, F16C, MOVBE: Intel Haswell 2013+, AMD Zen 2017+) or `--cpu x86-64-v4` (adds AVX-512
F/BW/CD/DQ/VL). `--cpu` takes any CPU name LLVM knows for this machine's triple (znver3, skylake-avx512, ...)
and refuses others before compiling; for `--target cuda` it names the CPU of the host code (default generic).
Built for this machine, the target also takes the AMX features /proc/cpuinfo lists (host_extra_features): a VM
may hide the CPU model LLVM names CPUs by, and with it AMX.
"""

from __future__ import annotations

import re
import shutil

import tvm
from tvm import relax
from tvm.relax.backend.cpu_generic import pipeline as cpu_generic
from tvm.relax.backend.cuda import pipeline as cuda
from tvm.relax.transform.fuse_transpose_matmul import FuseTransposeMatmul
from tvm.s_tir import dlight
from tvm.support import nvcc

from ...errors import LlmlowerError
from ...runtime.cpu_features import CPU_FLAGS, host_cpu_flags
from .cpu_schedule import WeightRowMatmul
from .low_batch import SimtMatmul, low_batch_dispatch

TARGETS = ("cpu", "cuda")
# compiled: the Relax VM's functions (a step's ~850 kernel calls, shapes and allocations) become native code;
# bytecode: the VM interprets them, which lets a per-call instrument time each call (benchmarks/profile_step.py)
VM_EXEC_MODES = ("compiled", "bytecode")
HOST_EXTRAS = ("amx-tile", "amx-int8", "amx-bf16")  # LLVM features a VM's CPU name may hide (their flags: cpu_features)
CUDA_ARCHS = ("sm_75", "sm_80", "sm_86", "sm_89", "sm_90")
DEFAULT_CUDA_ARCH = "sm_80"


def check_target(target: str, cuda_arch: str | None = None) -> None:
    if target not in TARGETS:
        raise LlmlowerError(f"--target {target!r}: the tvm backend builds for {', '.join(TARGETS)}")
    if cuda_arch is not None and target != "cuda":
        raise LlmlowerError("--cuda-arch applies to --target cuda only")
    if cuda_arch is not None and not re.fullmatch(r"sm_\d{2,3}a?", cuda_arch):
        raise LlmlowerError(f"--cuda-arch {cuda_arch!r}: expected an architecture like {', '.join(CUDA_ARCHS)}")


def accuracy_level(target: str, asked: int | None) -> int:
    """The level the build uses: 4 (grouped quantized matmuls in int8 where the CPU has an int8 dot
    product) by default on cpu, 0 (float) on cuda; refused: other levels, and 4 on cuda."""
    level = asked if asked is not None else 4 if target == "cpu" else 0
    if level not in (0, 4):
        raise LlmlowerError(f"--accuracy-level {level}: the tvm backend takes 0 (float32) or 4 (int8 activations)")
    if level and target != "cpu":
        raise LlmlowerError(f"--accuracy-level {level}: the tvm backend's int8 matmuls are CPU kernels (--target cpu)")
    return level


def vm_exec(target: str, asked: str | None) -> str:
    """How the Relax VM runs the step's functions: compiled by default on cpu, bytecode on cuda (the compiled VM
    has not run on a GPU yet)."""
    mode = asked or ("compiled" if target == "cpu" else "bytecode")
    if mode not in VM_EXEC_MODES:
        raise LlmlowerError(f"--vm-exec {mode!r}: the tvm backend takes {' or '.join(VM_EXEC_MODES)}")
    return mode


def check_options(target: str, options: dict[str, str]) -> None:
    """The backends table's check of the compile options (accuracy_level, cuda_arch, cpu, vm_exec), before anything
    is compiled."""
    check_target(target, options.get("cuda_arch"))
    accuracy_level(target, options.get("accuracy_level"))
    vm_exec(target, options.get("vm_exec"))
    cpu = options.get("cpu")
    if cpu is None and target == "cpu":  # this machine's CPU as LLVM detects it: does its feature set hold here?
        from ...runtime.cpu_features import PORTABLE_CPUS, machine_of, missing_cpu_features

        built = cpu_manifest(tvm_target("cpu"))
        arch = machine_of(built["triple"])
        missing = missing_cpu_features(built["cpu_features"], arch)
        if missing:
            raise LlmlowerError(
                f"this CPU is detected as {built['cpu']}, whose instructions {', '.join(missing)} it lacks (a "
                f"virtual machine hiding them?): compile with {PORTABLE_CPUS.get(arch, '--cpu generic')}, or "
                "--cpu naming a CPU this machine is"
            )
    if cpu is not None:
        triple = tvm.target.codegen.llvm_get_system_triple()
        if not tvm.target.codegen.llvm_is_valid_cpu(cpu, triple):
            raise LlmlowerError(
                f"--cpu {cpu!r}: not a CPU LLVM {tvm.target.codegen.llvm_version_major()} knows for {triple} "
                f"(portable: x86-64-v2, x86-64-v3, x86-64-v4; this machine: {host_cpu()})"
            )


def host_cpu() -> str:
    """LLVM's name for this machine's CPU (e.g. znver3, skylake-avx512)."""
    return tvm.target.codegen.llvm_get_system_cpu()


def host_extra_features() -> list[str]:
    """Features (LLVM's -mattr) this CPU has that LLVM's name for it may leave out: AMX's int8 tiles, which the
    int8 kernel's many-row calls take (a VM that hides its CPU model gets Sapphire Rapids named rocketlake)."""
    flags = host_cpu_flags() or set()
    return [f"+{feature}" for feature in HOST_EXTRAS if CPU_FLAGS["x86_64"][feature] in flags]


def cpu_manifest(target: tvm.target.Target) -> dict[str, object]:
    """What the library's CPU code was built for: the LLVM triple, the CPU (-mcpu) and every feature LLVM enables
    for it (ISA extensions such as avx2 or avx512f, and tuning flags), for the runtime's check of the host."""
    host = target.host or target
    return {
        "triple": host.attrs.get("mtriple") or tvm.target.codegen.llvm_get_system_triple(),
        "cpu": host.attrs.get("mcpu") or "generic",
        "cpu_features": sorted(str(f) for f in tvm.target.codegen.llvm_get_cpu_features(host)),
    }


def tvm_target(target: str, cuda_arch: str | None = None, cpu: str | None = None) -> tvm.target.Target:
    """The TVM target for llmlower's `target` word: cpu -> llvm for this CPU (or `cpu`); cuda -> the arch,
    with generic llvm host code for the kernel launches."""
    check_target(target, cuda_arch)
    if target == "cpu":
        extras = {} if cpu else {"mattr": host_extra_features()}  # a named CPU: exactly its features
        return tvm.target.Target({"kind": "llvm", "mcpu": cpu or host_cpu(), **extras})
    host = {"kind": "llvm", **({"mcpu": cpu} if cpu else {})}  # the GPU machine's CPU is not this one
    return tvm.target.Target({"kind": "cuda", "arch": cuda_arch or DEFAULT_CUDA_ARCH, "host": host})


def _schedules(target: tvm.target.Target) -> tvm.transform.Pass:
    if target.kind.name == "cuda":
        rules = (
            SimtMatmul(),
            dlight.gpu.GEMV(),
            dlight.gpu.Reduction(),
            dlight.gpu.GeneralReduction(),
            dlight.gpu.Fallback(),
        )
    else:
        rules = (WeightRowMatmul(), dlight.cpu.Reduction())
    return dlight.ApplyDefaultSchedule(*rules)


def pipeline(target: tvm.target.Target) -> tvm.transform.Pass:
    """TVM's default lowering for the target's kind, with DLight scheduling after fusion."""
    backend = cuda if target.kind.name == "cuda" else cpu_generic
    return tvm.transform.Sequential(
        [
            FuseTransposeMatmul(),
            *backend.library_dispatch_passes(target),
            *cpu_generic.legalize_passes(target),  # LegalizeOps .. FuseTIR (CUDA's adds a fixed DLight set)
            *([low_batch_dispatch] if target.kind.name == "cuda" else []),
            _schedules(target),
            *backend.dataflow_lower_passes(target),
            *backend.finalize_passes(target),
        ]
    )


def compile_module(module: tvm.IRModule, target: tvm.target.Target, exec_mode: str | None = None) -> relax.VMExecutable:
    """The executable of `module`, its VM functions run as `exec_mode` (VM_EXEC_MODES; default: vm_exec's)."""
    exec_mode = vm_exec("cuda" if target.kind.name == "cuda" else "cpu", exec_mode)
    with target:
        return relax.build(module, target=target, relax_pipeline=pipeline(target), exec_mode=exec_mode)


def cuda_source(executable: relax.VMExecutable) -> str:
    """The CUDA C of a cuda build's kernels (TVM keeps them as source, for a JIT compile when loaded)."""
    modules = [executable.mod]
    while modules:
        module = modules.pop()
        if module.kind == "cuda":
            return module.inspect_source("")
        modules.extend(module.imports)
    raise LlmlowerError("the cuda build holds no CUDA kernels")


def cuda_binary(executable: relax.VMExecutable, target: tvm.target.Target) -> tuple[str, bytes]:
    """The kernels' CUDA source and their fatbin for the target's architecture, compiled here by nvcc, so an
    artifact carries GPU code and the GPU machine needs no compiler."""
    if shutil.which("nvcc") is None:
        raise LlmlowerError("--target cuda needs nvcc (the CUDA toolkit) on PATH to compile the GPU kernels")
    source = cuda_source(executable)
    with target:
        binary = nvcc.compile_cuda(source, target_format="fatbin", arch=target.attrs["arch"], compiler="nvcc")
    return source, bytes(binary)
