"""Can this CPU run a library compiled for another one? LLVM names the instruction-set features a build may use
(avx2, avx512f, ...); Linux lists the CPU's in /proc/cpuinfo. A library needing a feature this CPU lacks would die
with SIGILL at its first kernel: refuse it first, naming the features (plain Python: the runtime's loaders use it)."""

from __future__ import annotations

import platform
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .artifact import ArtifactError

# LLVM feature -> Linux /proc/cpuinfo flag, for the ISA extensions LLVM's code generation uses by itself in
# compute code (a library built with one uses its instructions anywhere). LLVM's other features are tuning flags
# (fast-*, slow-*, macrofusion, ...) or system instructions compute kernels never contain (xsave, pku, shstk,
# rdpru, wbnoinvd, ...); they are recorded in the manifest but not checked.
CPU_FLAGS = {
    "x86_64": {
        "cmov": "cmov",
        "cx8": "cx8",
        "cx16": "cx16",
        "mmx": "mmx",
        "fxsr": "fxsr",
        "sse": "sse",
        "sse2": "sse2",
        "sse3": "pni",
        "ssse3": "ssse3",
        "sse4.1": "sse4_1",
        "sse4.2": "sse4_2",
        "sse4a": "sse4a",
        "crc32": "sse4_2",
        "popcnt": "popcnt",
        "sahf": "lahf_lm",
        "movbe": "movbe",
        "lzcnt": "abm",
        "bmi": "bmi1",
        "bmi2": "bmi2",
        "tbm": "tbm",
        "adx": "adx",
        "avx": "avx",
        "avx2": "avx2",
        "fma": "fma",
        "fma4": "fma4",
        "xop": "xop",
        "f16c": "f16c",
        "aes": "aes",
        "pclmul": "pclmulqdq",
        "sha": "sha_ni",
        "gfni": "gfni",
        "vaes": "vaes",
        "vpclmulqdq": "vpclmulqdq",
        "avx512f": "avx512f",
        "avx512cd": "avx512cd",
        "avx512dq": "avx512dq",
        "avx512bw": "avx512bw",
        "avx512vl": "avx512vl",
        "avx512ifma": "avx512ifma",
        "avx512vbmi": "avx512vbmi",
        "avx512vbmi2": "avx512_vbmi2",
        "avx512vnni": "avx512_vnni",
        "avx512bitalg": "avx512_bitalg",
        "avx512vpopcntdq": "avx512_vpopcntdq",
        "avx512bf16": "avx512_bf16",
        "avx512fp16": "avx512_fp16",
        "avx512vp2intersect": "avx512_vp2intersect",
        "avxvnni": "avx_vnni",
        "amx-tile": "amx_tile",
        "amx-int8": "amx_int8",
        "amx-bf16": "amx_bf16",
        "amx-fp16": "amx_fp16",
    },
    "aarch64": {
        "fp-armv8": "fp",
        "neon": "asimd",
        "fullfp16": "asimdhp",
        "rdm": "asimdrdm",
        "dotprod": "asimddp",
        "fp16fml": "asimdfhm",
        "crc": "crc32",
        "lse": "atomics",
        "aes": "aes",
        "sha2": "sha2",
        "sha3": "sha3",
        "i8mm": "i8mm",
        "bf16": "bf16",
        "sve": "sve",
        "sve2": "sve2",
    },
}
PORTABLE_CPUS = {"x86_64": "--cpu x86-64-v2 or x86-64-v3", "aarch64": "--cpu generic"}
MACHINES = {"amd64": "x86_64", "x64": "x86_64", "arm64": "aarch64"}  # platform.machine() spellings


def _machine(name: str) -> str:
    name = name.lower()
    return MACHINES.get(name, name)


def host_cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> set[str] | None:
    """This CPU's feature flags as Linux lists them (x86 `flags`, aarch64 `Features`); None where unknown."""
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return set(value.split())
    except OSError:
        pass
    return None


def machine_of(triple: str) -> str:
    """The architecture of an LLVM triple (x86_64-conda-linux-gnu -> x86_64), as platform.machine() names it."""
    return _machine(str(triple).split("-")[0])


def missing_cpu_features(features: Sequence[str], arch: str, flags: set[str] | None = None) -> list[str]:
    """The ISA features among `features` (LLVM names, CPU_FLAGS) that this CPU lacks; [] where unknown."""
    flags = host_cpu_flags() if flags is None else flags
    table = CPU_FLAGS.get(arch)
    if flags is None or table is None:
        return []
    return [feature for feature in features if feature in table and table[feature] not in flags]


def host_cpu_refusal(built: Mapping[str, Any], flags: set[str] | None = None) -> str | None:
    """Why this machine cannot run CPU code built as `built` says (its triple, cpu and cpu_features): another
    architecture, or ISA features (CPU_FLAGS) this CPU lacks; None when it can. Builds that record no features,
    and hosts whose flags are unknown (not Linux), are not checked."""
    features, triple = built.get("cpu_features"), built.get("triple")
    if not features or not triple:
        return None
    arch, here = machine_of(triple), _machine(platform.machine())
    cpu = built.get("cpu") or "generic"
    if arch != here:
        return f"its library was built for {arch} (--cpu {cpu}); this machine is {here}"
    missing = missing_cpu_features(features, arch, flags)
    if missing:
        return (
            f"its library was built for --cpu {cpu}, with instructions this CPU lacks: {', '.join(missing)} (it "
            f"would stop with SIGILL); recompile it for this machine, or portably with "
            f"{PORTABLE_CPUS.get(arch, '--cpu generic')}"
        )
    return None


def check_host_cpu(artifact: Path, built: Mapping[str, Any], flags: set[str] | None = None) -> None:
    """Refuse an artifact whose CPU code this machine cannot run (host_cpu_refusal), naming it."""
    reason = host_cpu_refusal(built, flags)
    if reason is not None:
        raise ArtifactError(f"{artifact}: {reason}")
