"""Executor on the TVM Relax VM: runs a library compiled by llmlower's TVM backend (needs numpy, safetensors
and TVM's runtime).

The KV cache is TVM's paged KV cache, created once by the library's `create_kv_cache`. The executor keeps
TVM's sequences in step with the runtime's slots: a slot seen for the first time is added, a slot starting
over (past 0) is removed and added again, a slot whose step says it holds fewer tokens than TVM's sequence is
cut back (popn), and `fork` shares a prefix copy-on-write. Each step is begin_forward -> prefill or decode
(one token per sequence) -> end_forward, the step's real tokens passed ragged as the cache wants them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.numpy
import tvm
import tvm_ffi
from tvm import relax
from tvm.runtime import ShapeTuple

from ...errors import GenerationError
from ..executor import Executor, PaddedBatch, StepBatch, last_token_logits, pad_batch

PAGE_SIZE = 16
DEVICES = {"cpu": tvm.cpu, "cuda": tvm.cuda}


def _builtin(name: str) -> tvm.runtime.PackedFunc:
    return tvm.get_global_func(f"vm.builtin.{name}")


def ragged_rows(input_lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For a right-padded [batch, tokens] step: the flat index of each real token (sequence after sequence),
    and for each padded position the ragged row it reads back (padding reads its sequence's last token)."""
    width = int(input_lens.max())
    steps = np.arange(width)[None, :]
    real = np.flatnonzero((steps < input_lens[:, None]).reshape(-1))
    offsets = np.cumsum(input_lens) - input_lens
    back = offsets[:, None] + np.minimum(steps, input_lens[:, None] - 1)
    return real.astype(np.int64), back.reshape(-1).astype(np.int64)


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


class TvmExecutor(Executor):
    def __init__(
        self,
        library: str,
        weights: Mapping[str, np.ndarray],
        inputs: Sequence[str],
        device: str = "cpu",
        max_batch: int = 4,
        max_context: int = 2048,
        all_positions: bool = False,
        threads: int = 0,
    ) -> None:
        if threads > 0:
            tvm.get_global_func("runtime.config_threadpool")(1, threads)  # TVM's pool: 1 = big cores first
        self.device = DEVICES[device](0)
        self.vm = relax.VirtualMachine(tvm.runtime.load_module(library), self.device)
        self.params = [tvm.runtime.tensor(w, self.device) for w in weights.values()]
        self.inputs = list(inputs)
        self.max_batch, self.max_context, self.all_positions = max_batch, max_context, all_positions
        tokens = max_batch * max_context
        sizes = ShapeTuple([max_batch, tokens, tokens, PAGE_SIZE, 0])
        self.cache = self.vm["create_kv_cache"](sizes)
        self.lengths: dict[int, int] = {}  # tokens TVM's cache holds per slot

    @classmethod
    def from_artifact(
        cls, artifact: Path, manifest: dict[str, Any], max_batch: int, max_context: int, threads: int = 0
    ) -> TvmExecutor:
        device_code = manifest["tvm"].get("device_code")
        if device_code is not None:
            use_prebuilt_kernels((artifact / device_code["file"]).read_bytes(), device_code["source_sha256"])
        weights = safetensors.numpy.load_file(str(artifact / manifest["weights"]["file"]))
        prefill = manifest["entry_points"]["prefill"]
        return cls(
            str(artifact / prefill["file"]),
            {name: weights[name] for name in manifest["weights"]["order"]},
            [t["name"] for t in prefill["inputs"]],
            device=manifest["target"],
            max_batch=max_batch,
            max_context=max_context,
            all_positions=prefill["outputs"][0]["shape"][1] == "tokens",
            threads=threads,
        )

    def step(self, batch: StepBatch) -> np.ndarray:
        padded = pad_batch(batch)
        return last_token_logits(self._run(batch.slots, padded), padded.input_lens)

    def prompt_logits(self, tokens: Sequence[int]) -> np.ndarray:
        if not self.all_positions:
            raise GenerationError("this model computes last-token logits only; compile without last_token_logits")
        return self._run([0], pad_batch(StepBatch([0], [tokens], [0])))[0].astype(np.float32)

    def fork(self, parent: int, child: int, length: int) -> None:
        """Slot `child` starts as the first `length` tokens of slot `parent` (pages shared, copy-on-write)."""
        held = self.lengths.get(parent, 0)
        if not 0 < length <= held:
            raise GenerationError(f"fork: slot {parent} holds {held} tokens, cannot share {length}")
        self._release(child)
        _builtin("kv_state_fork_sequence")(self.cache, parent, child, length)
        self.lengths[child] = length

    def _release(self, slot: int) -> None:
        if self.lengths.pop(slot, None) is not None:
            _builtin("kv_state_remove_sequence")(self.cache, slot)

    def _sync(self, slot: int, past: int) -> None:
        """Make TVM's sequence for `slot` hold exactly its first `past` tokens."""
        if past == 0:
            self._release(slot)
        held = self.lengths.setdefault(slot, 0)
        if held == 0 and past == 0:
            _builtin("kv_state_add_sequence")(self.cache, slot)
        elif held < past:
            raise GenerationError(f"slot {slot}: the step continues after {past} tokens, the cache holds {held}")
        elif held > past:
            _builtin("kv_state_popn")(self.cache, slot, held - past)
        self.lengths[slot] = past

    def _run(self, slots: Sequence[int], padded: PaddedBatch) -> np.ndarray:
        """Run prefill (or decode when every sequence brings one token); returns the logits."""
        used = int((padded.past_lens + padded.input_lens).max())
        if used > self.max_context:
            raise GenerationError(f"step needs {used} cache positions; the executor holds {self.max_context}")
        if max(slots) >= self.max_batch or len(set(slots)) != len(slots):
            raise GenerationError(f"slots {list(slots)}: expected distinct slots below {self.max_batch}")
        for slot, past in zip(slots, padded.past_lens.tolist(), strict=True):
            self._sync(slot, past)
        real, back = ragged_rows(padded.input_lens)
        values = {
            "input_ids": padded.input_ids,
            "position_ids": padded.position_ids,
            "past_lens": padded.past_lens,
            "input_lens": padded.input_lens,
            "ragged_rows": real,
            "padded_rows": back,
        }
        args = [
            self.cache if name == "paged_kv_cache" else tvm.runtime.tensor(values[name], self.device)
            for name in self.inputs
        ]
        _builtin("kv_state_begin_forward")(self.cache, ShapeTuple(list(slots)), ShapeTuple(padded.input_lens.tolist()))
        function = "decode" if padded.input_ids.shape[1] == 1 else "prefill"
        logits = self.vm[function](*args, *self.params)
        _builtin("kv_state_end_forward")(self.cache)
        for slot, total in zip(slots, (padded.past_lens + padded.input_lens).tolist(), strict=True):
            self.lengths[slot] = total
        return logits.numpy()
