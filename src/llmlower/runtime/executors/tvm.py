"""Executor on the TVM Relax VM: runs a library compiled by llmlower's TVM backend (needs numpy, safetensors
and TVM's runtime); its weights come from the artifact's weights file or are made up (runtime.weights).

The KV cache is one pair of block pools per layer, [num_blocks, block_size, kv_heads, head_dim] tensors on the
VM's device, allocated here (zeros) and owned by the executor; the runtime's block tables are the only record of
which blocks a sequence uses. A step packs the batch's tokens (pack_batch) and calls the library's `step` with
the program's own inputs and the pools, which its paged-attention kernels update in place; `copy_blocks` copies
blocks on the device through the library's `copy_blocks`.

Before an artifact's library is loaded, `from_artifact` checks that this machine can run it: a cuda artifact
needs a CUDA device TVM's runtime can open (no silent CPU run), and the CPU code's ISA features the manifest
records (avx2, avx512f, ...: backends.tvm.compile.cpu_manifest) must all be in this CPU's (/proc/cpuinfo),
else the artifact is refused naming the missing ones, instead of the first kernel dying with SIGILL.

Only TVM's runtime is used (tvm.runtime, its VM and libtvm_runtime*.so): an artifact also runs on a host whose
TVM is the runtime alone, without the compiler library (libtvm_compiler.so, most of the wheel's size).
"""

from __future__ import annotations

import hashlib
import math
import os
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import tvm
import tvm_ffi
from tvm.runtime.vm import VirtualMachine
from tvm_ffi.libinfo import load_lib_ctypes

from ...errors import GenerationError
from ...step_io import KVLayout, cache_layer, state_layer
from ..artifact import ArtifactError, kv_cache_dtype
from ..cpu_features import check_host_cpu, host_cpu_refusal
from ..executor import (
    Executor,
    PackedBatch,
    StepBatch,
    copy_rounds,
    pack_batch,
    state_slot_count,
    step_arrays,
    step_logits,
)
from ..lora import LoraBank
from ..weights import ARTIFACT_WEIGHTS, WeightSource

STEP, COPY_BLOCKS = "step", "copy_blocks"
DEVICES = {"cpu": tvm.cpu, "cuda": tvm.cuda}
SHARE_ALL_CORES = -3  # TVM's kSpecifyThreadShareAllCore: the threads may run on any of the named CPUs
CUDA_RUNTIME = "tvm_runtime_cuda"  # TVM's CUDA device API and module loader, beside libtvm_runtime.so
_loaded: dict[str, object] = {}  # the libraries loaded here, kept alive


def load_cuda_runtime() -> str | None:
    """Register TVM's CUDA runtime if `import tvm` did not (it loads libtvm_runtime_cuda.so only beside its
    compiler library, and ignores a failure): a runtime-only TVM loads it here. Returns why it does not load
    (a CUDA library missing, such as the driver's libcuda.so.1), or None."""
    if tvm.get_global_func("device_api.cuda", allow_missing=True) is not None or CUDA_RUNTIME in _loaded:
        return None
    try:
        _loaded[CUDA_RUNTIME] = load_lib_ctypes("tvm", CUDA_RUNTIME, "RTLD_LOCAL", tvm.libinfo.package_lib_paths())
    except (OSError, RuntimeError) as exc:
        return f"lib{CUDA_RUNTIME}.so does not load: {exc}"
    return None


def check_device(artifact: Path, device: str) -> None:
    """A cuda artifact needs a CUDA device TVM's runtime can open: say so rather than fail later or run on
    the CPU."""
    if device not in DEVICES:
        raise ArtifactError(f"{artifact}: target {device!r}; TVM artifacts run on {', '.join(DEVICES)}")
    if device == "cuda":
        reason = load_cuda_runtime() or "no NVIDIA GPU or driver, or a TVM built without CUDA"
        if not tvm.cuda(0).exist:
            raise ArtifactError(
                f"{artifact}: this artifact runs on CUDA, and TVM's runtime here finds no CUDA device ({reason}); "
                "compile it with --target cpu to run on the CPU"
            )


# The CPUs this process may run on, read at import: TVM pins a thread whose pool starts unconfigured to one CPU,
# and threads started from it inherit that.
PROCESS_CPUS = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def physical_cores() -> int:
    """This process's CPUs counted as cores, a core's hyper-threads once (Linux's topology files; every CPU counts
    where they are absent): the default thread count, as ONNX Runtime's."""
    cores = set()
    for cpu in PROCESS_CPUS:
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add(((topology / "physical_package_id").read_text(), (topology / "core_id").read_text()))
        except OSError:
            return len(PROCESS_CPUS)
    return len(cores)


def use_threads(threads: int) -> None:
    """Run the calling thread's TVM kernels on `threads` threads (TVM's pool is per calling thread). Named, this
    process's CPUs lift the cap TVM otherwise puts on the pool when it starts: half the logical CPUs on x86
    (hyper-threads assumed), which is one thread on a 2-vCPU VM whatever is asked."""
    tvm.get_global_func("runtime.config_threadpool")(SHARE_ALL_CORES, threads, [str(c) for c in PROCESS_CPUS])


def use_prebuilt_kernels(binary: bytes, source_sha256: str) -> None:
    """Make TVM's CUDA loader, which compiles a library's kernel source when it loads it, take the artifact's
    prebuilt binary for that source instead (other sources still go to TVM's own compiler)."""
    jit = tvm.get_global_func("tvm_callback_cuda_compile", allow_missing=True)

    def compile_cuda(code: str, *args: Any) -> bytes:
        if hashlib.sha256(code.encode()).hexdigest() == source_sha256:
            return binary
        if jit is None:
            raise GenerationError(
                "a CUDA kernel source differs from the artifact's prebuilt one and no compiler is set"
            )
        return jit(code, *args)

    tvm_ffi.register_global_func("tvm_callback_cuda_compile", compile_cuda, override=True)


def pool_shapes(inputs: Sequence[Mapping[str, Any]]) -> dict[str, tuple[int, int]]:
    """Each KV pool's (kv_heads, head_dim) from the step's inputs as the manifest lists them
    ([num_blocks, block_size, kv_heads, head_dim])."""
    return {t["name"]: tuple(t["shape"][2:]) for t in inputs if cache_layer(t["name"]) is not None}


def state_specs(inputs: Sequence[Mapping[str, Any]]) -> dict[str, tuple[tuple[int, ...], str]]:
    """Each recurrent state's (one sequence's shape, dtype) from the step's inputs as the manifest lists them
    ([slots, ...])."""
    return {t["name"]: (tuple(t["shape"][1:]), t["dtype"]) for t in inputs if state_layer(t["name"]) is not None}


def aligned_empty(size: int, dtype: np.dtype, alignment: int = 64) -> np.ndarray:
    """An uninitialized 1-D array of `size` elements at an `alignment`-byte address (what a TVM tensor's data must
    be)."""
    space = np.empty(size * dtype.itemsize + alignment, np.uint8)
    start = -space.ctypes.data % alignment
    return space[start : start + size * dtype.itemsize].view(dtype)


def aligned_zeros(shape: tuple[int, ...], dtype: type) -> np.ndarray:
    """A zeroed array at a 64-byte address (a TVM tensor's data, shared without a copy)."""
    array = aligned_empty(math.prod(shape), np.dtype(dtype)).reshape(shape)
    array[...] = 0
    return array


class TvmExecutor(Executor):
    def __init__(
        self,
        library: str,
        weights: Mapping[str, np.ndarray],
        inputs: Sequence[str],
        *,
        pools: Mapping[str, tuple[int, int]],
        dtype: str,
        block_size: int,
        num_blocks: int,
        max_context: int,
        device: str = "cpu",
        all_positions: bool = False,
        threads: int = 0,
        states: Mapping[str, tuple[tuple[int, ...], str]] | None = None,
        lora: LoraBank | None = None,
    ) -> None:
        """`inputs`: the step function's data inputs in call order (the weights follow them, in `weights`'
        order); `pools`: each KV pool's (kv_heads, head_dim), every pool of its own (values of their own head
        size, MLA's latent); `all_positions`: the step returns every packed token's logits (no last_token_logits);
        `states`: a hybrid model's recurrent states, name -> (one sequence's shape, dtype); `lora`: the adapter
        slots of a model compiled with them (on the CPU the step reads their arrays in place)."""
        self.threads, self._pooled = threads, threading.local()
        self.states = {}
        self.kv_layout = KVLayout.PAGED
        self.block_size, self.num_blocks, self.max_context = block_size, num_blocks, max_context
        self.all_positions = all_positions
        self.device, self.on_cpu = DEVICES[device](0), device == "cpu"
        self.vm = VirtualMachine(tvm.runtime.load_module(library), self.device)
        self._step, self._copy_blocks = self.vm[STEP], self.vm[COPY_BLOCKS]
        self.params = [tvm.runtime.tensor(w, self.device) for w in weights.values()]
        self.inputs = list(inputs)
        self._staged: dict[str, np.ndarray] = {}  # CPU: each step input's aligned buffer, grown as steps need
        self.pools = {
            name: tvm.runtime.tensor(np.zeros((num_blocks, block_size, *shape), dtype), self.device)
            for name, shape in pools.items()
        }
        self._kv_pools = list(self.pools.values())
        if states:  # a hybrid model's: numpy rows the kernels update in place through zero-copy views
            if not self.on_cpu:
                raise GenerationError("recurrent states run on the CPU only (their kernels are CPU kernels)")
            self.num_state_slots = state_slot_count(num_blocks, max_context, block_size)
            for name, (shape, state_dtype) in states.items():
                rows = aligned_empty(self.num_state_slots * math.prod(shape), np.dtype(state_dtype))
                rows[:] = 0
                self.states[name] = rows.reshape(self.num_state_slots, *shape)
                self.pools[name] = tvm.runtime.from_dlpack(self.states[name])
        self.lora, self._lora_version = lora, -1
        for name, array in ({} if lora is None else lora.arrays).items():
            self.pools[name] = (
                tvm.runtime.from_dlpack(array) if self.on_cpu else tvm.runtime.empty(array.shape, device=self.device)
            )
        missing = [name for name in self.pools if name not in self.inputs]
        if missing:
            raise GenerationError(f"the step function takes no pools {', '.join(missing)}")

    @classmethod
    def refusal(cls, manifest: Mapping[str, Any]) -> str | None:
        """A library built for a CPU this one is not (--cpu) cannot run here."""
        return host_cpu_refusal(manifest.get("tvm", {}))

    @classmethod
    def from_artifact(
        cls,
        artifact: Path,
        manifest: dict[str, Any],
        num_blocks: int,
        block_size: int,
        max_context: int,
        threads: int = 0,
        weights: WeightSource = ARTIFACT_WEIGHTS,
    ) -> TvmExecutor:
        check_device(artifact, manifest["target"])  # before any of its files is loaded
        check_host_cpu(artifact, manifest.get("tvm", {}))
        layout = manifest["kv_layout"]
        if layout["kind"] != KVLayout.PAGED.value or layout["block_size"] != block_size:
            raise GenerationError(
                f"{artifact}: KV layout {layout['kind']} of blocks of {layout.get('block_size')}, asked for paged "
                f"blocks of {block_size}"
            )
        device_code = manifest["tvm"].get("device_code")
        if device_code is not None:
            use_prebuilt_kernels((artifact / device_code["file"]).read_bytes(), device_code["source_sha256"])
        step = manifest["entry_points"][STEP]
        return cls(
            str(artifact / step["file"]),
            weights.arrays(artifact, manifest),
            [t["name"] for t in step["inputs"]],
            pools=pool_shapes(step["inputs"]),
            dtype=kv_cache_dtype(manifest),
            block_size=block_size,
            num_blocks=num_blocks,
            max_context=max_context,
            device=manifest["target"],
            all_positions=step["outputs"][0]["shape"][1] == "tokens",
            threads=threads,
            states={
                t["name"]: (tuple(t["shape"][1:]), t["dtype"])
                for t in step["inputs"]
                if state_layer(t["name"]) is not None
            },
            lora=LoraBank.of_step(step["inputs"], manifest["pipeline"], aligned_zeros),
        )

    def step(self, batch: StepBatch) -> np.ndarray:
        self.check_step(batch)
        packed = pack_batch(batch)
        return step_logits(self._run(packed), packed.logits_indices, self.all_positions)

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        for source, destination in pairs:
            if not (0 <= source < self.num_blocks and 0 <= destination < self.num_blocks):
                raise GenerationError(f"copy_blocks: block pair {(source, destination)} is outside the pool")
        if not self._kv_pools:  # a model without attention: its blocks only count its tokens
            return
        self._configure_pool()
        pools = self._kv_pools
        for sources, destinations in copy_rounds(pairs):
            indices = [tvm.runtime.tensor(np.array(i, dtype=np.int32), self.device) for i in (sources, destinations)]
            self._copy_blocks(*pools, *indices)  # in place: the returned pools are these tensors

    def _run(self, packed: PackedBatch) -> np.ndarray:
        """Run the step function on a packed batch; returns the program's logits: on the CPU a view of the step's
        output tensor, which it keeps alive (copying 16 streams' logits, 3 MB, took a third of a millisecond)."""
        self._configure_pool()
        if self.states:
            packed = packed.with_state_rows()
        values = step_arrays(packed)
        if self.lora is not None and not self.on_cpu and self._lora_version != self.lora.version:
            for name, array in self.lora.arrays.items():  # the device's copy of the adapters, after a load
                self.pools[name].copyfrom(array)
            self._lora_version = self.lora.version
        args = [self.pools[name] if name in self.pools else self._input(name, values[name]) for name in self.inputs]
        logits = self._step(*args, *self.params)
        return np.from_dlpack(logits) if self.on_cpu else logits.numpy()

    def _input(self, name: str, array: np.ndarray) -> tvm.runtime.Tensor:
        """A step input on the device; on the CPU a view of the input's staging buffer, `array` copied in, alive
        for the call: checking each array's alignment and copying the unaligned ones took ~20 us an input between
        two decode steps (their code and data out of the caches)."""
        if not self.on_cpu:
            return tvm.runtime.tensor(array, self.device)
        buffer = self._staged.get(name)
        if buffer is None or buffer.size < array.size or buffer.dtype != array.dtype:
            grown = max(array.size, 0 if buffer is None else 2 * buffer.size)
            buffer = self._staged[name] = aligned_empty(grown, array.dtype)
        view = buffer[: array.size].reshape(array.shape)
        view[...] = array
        return tvm.runtime.from_dlpack(view)

    def _configure_pool(self) -> None:
        """Give the calling thread's TVM pool `threads` threads (0: one per core, physical_cores), once per thread
        (an engine steps on its own thread, not the one that built the executor)."""
        if not getattr(self._pooled, "done", False):
            use_threads(self.threads or physical_cores())
            self._pooled.done = True
