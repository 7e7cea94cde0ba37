"""LoRA adapters at run time: PEFT adapter directories read without torch, and the bank of adapter slots an artifact
compiled with the lora pass takes as step inputs (see passes/lora.py). An adapter's A fills its slot's rows of
lora_a__<module> [slots * rank, in], its B times PEFT's scaling its slot's columns of lora_b__<module>
[out, slots * rank]; a smaller rank than the artifact's leaves the rest of the slot zero."""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ArgumentError, GenerationError
from ..step_io import LORA_PREFIXES, lora_module, lora_names

Allocator = Callable[[tuple[int, ...], type], np.ndarray]
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64}
_KEY = re.compile(r"(?:base_model\.model\.)?(.+)\.lora_([AB])(?:\.[^.]+)?\.weight")
_UNSUPPORTED = {  # PEFT options whose adapters are not W + scaling * B A on a linear's input
    "use_dora": "DoRA's magnitude vectors",
    "fan_in_fan_out": "Conv1D layers (fan_in_fan_out)",
    "modules_to_save": "fully trained modules (modules_to_save)",
}


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file as float32 (bfloat16 widened), each checked to lie inside the file."""
    data = path.read_bytes()
    if len(data) < 8:
        raise ArgumentError(f"{path}: not a safetensors file (too short)")
    (length,) = struct.unpack("<Q", data[:8])
    try:
        header = json.loads(data[8 : 8 + length])
    except (ValueError, UnicodeDecodeError) as exc:
        raise ArgumentError(f"{path}: not a safetensors file ({exc})") from None
    body = memoryview(data)[8 + length :]
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype = _DTYPES.get(entry.get("dtype"))
        start, end = entry.get("data_offsets", (0, -1))
        shape = entry.get("shape", [])
        if dtype is None:
            raise ArgumentError(f"{path}: tensor {name}: dtype {entry.get('dtype')} (expected F32, F16 or BF16)")
        if not 0 <= start <= end <= len(body) or end - start != np.dtype(dtype).itemsize * int(np.prod(shape)):
            raise ArgumentError(f"{path}: tensor {name}: data_offsets {[start, end]} do not fit shape {shape}")
        array = np.frombuffer(body[start:end], dtype=dtype).reshape(shape)
        if entry["dtype"] == "BF16":
            array = (array.astype(np.uint32) << 16).view(np.float32)
        tensors[name] = array.astype(np.float32)
    return tensors


def _pattern_value(patterns: Mapping[str, Any], module: str, default: Any) -> Any:
    """PEFT's rank_pattern / alpha_pattern: the value of the first key that names the module (a suffix of its path
    or a regular expression matching it)."""
    for key, value in patterns.items():
        if re.fullmatch(rf"(.*\.)?{key}", module):
            return value
    return default


@dataclass(frozen=True)
class LoraAdapter:
    """A PEFT LoRA adapter: per module path (as PEFT names it, model.layers.0.self_attn.q_proj), A [rank, in] and
    B [out, rank] with PEFT's scaling folded into B."""

    path: Path
    weights: dict[str, tuple[np.ndarray, np.ndarray]]

    @property
    def rank(self) -> int:
        return max(a.shape[0] for a, _ in self.weights.values())

    @classmethod
    def read(cls, path: str | Path) -> LoraAdapter:
        """The adapter in a PEFT directory (adapter_config.json, adapter_model.safetensors); pickled weights
        (adapter_model.bin) are refused."""
        path = Path(path)
        config_file, weights_file = path / ADAPTER_CONFIG, path / ADAPTER_WEIGHTS
        if not config_file.is_file():
            raise ArgumentError(f"{path}: not a PEFT adapter directory (no {ADAPTER_CONFIG})")
        if not weights_file.is_file():
            pickled = (path / "adapter_model.bin").exists()
            found = " (adapter_model.bin is pickle, which llmlower does not load)" if pickled else ""
            raise ArgumentError(f"{path}: no {ADAPTER_WEIGHTS}{found}")
        try:
            config = json.loads(config_file.read_text())
        except ValueError as exc:
            raise ArgumentError(f"{config_file}: {exc}") from None
        if config.get("peft_type", "LORA") != "LORA":
            raise ArgumentError(f"{config_file}: peft_type {config.get('peft_type')!r}: only LORA adapters load")
        for field, what in _UNSUPPORTED.items():
            if config.get(field):
                raise ArgumentError(f"{config_file}: {field}: {what} are not supported")
        if config.get("bias", "none") != "none":
            raise ArgumentError(f"{config_file}: bias {config['bias']!r}: adapters with biases are not supported")
        parts: dict[str, dict[str, np.ndarray]] = {}
        for name, array in read_safetensors(weights_file).items():
            match = _KEY.fullmatch(name)
            if match is None or array.ndim != 2:
                raise ArgumentError(f"{weights_file}: tensor {name}: not a LoRA A or B matrix of a linear layer")
            parts.setdefault(match.group(1), {})[match.group(2)] = array
        weights = {}
        for module, pair in parts.items():
            if set(pair) != {"A", "B"} or pair["A"].shape[0] != pair["B"].shape[1]:
                raise ArgumentError(f"{weights_file}: {module}: expected lora_A [rank, in] and lora_B [out, rank]")
            rank = pair["A"].shape[0]
            declared = _pattern_value(config.get("rank_pattern") or {}, module, config.get("r", rank))
            alpha = _pattern_value(config.get("alpha_pattern") or {}, module, config.get("lora_alpha", declared))
            scaling = alpha / (declared**0.5 if config.get("use_rslora") else declared)
            weights[module] = (pair["A"], pair["B"] * np.float32(scaling))
        if not weights:
            raise ArgumentError(f"{weights_file}: no LoRA weights")
        return cls(path, weights)


class LoraBank:
    """The adapter slots of an artifact's step: one float32 array per lora input, which executors hand to every
    step (writing a slot changes what the next step computes for the tokens on it)."""

    def __init__(
        self, shapes: Mapping[str, Sequence[int]], rank: int, slots: int, allocate: Allocator = np.zeros
    ) -> None:
        """`allocate(shape, dtype)`: zeroed arrays where the executor needs them (a TVM tensor's alignment)."""
        self.rank, self.slots = rank, slots
        self.version = 0  # bumped by every write: a device copy of the arrays is stale when its version differs
        self.arrays = {name: allocate(tuple(shape), np.float32) for name, shape in shapes.items()}
        self.modules = sorted({lora_module(name) for name in self.arrays})

    @classmethod
    def of_step(
        cls, inputs: Sequence[Mapping[str, Any]], pipeline: Sequence[Mapping[str, Any]], allocate: Allocator = np.zeros
    ) -> LoraBank | None:
        """The bank for a step's inputs (name and shape dicts, as a manifest lists them) compiled by `pipeline`
        (whose lora pass's stats give the rank and slots); None without adapter slots."""
        shapes = {t["name"]: t["shape"] for t in inputs if t["name"].startswith(LORA_PREFIXES)}
        stats = [record.get("stats", {}) for record in pipeline if record.get("name") == "lora"]
        if not shapes or not stats:
            return None
        return cls(shapes, int(stats[-1]["rank"]), int(stats[-1]["max_loras"]), allocate)

    def _target(self, module: str) -> str:
        """The bank's module whose path ends with an adapter's module path (PEFT's, without the capture's
        wrapper prefixes)."""
        found = [m for m in self.modules if m == module or m.endswith("." + module)]
        if len(found) != 1:
            what = "no adapter slot" if not found else f"{len(found)} slots"
            raise ArgumentError(
                f"LoRA module {module}: the artifact has {what} for it (compiled targets: "
                f"{', '.join(m.rsplit('.', 1)[-1] for m in self.modules[:7])}, ...)"
            )
        return found[0]

    def check(self, adapter: LoraAdapter) -> None:
        """Raise an ArgumentError naming what of the adapter this bank cannot hold."""
        if adapter.rank > self.rank:
            raise ArgumentError(f"{adapter.path}: rank {adapter.rank} exceeds the artifact's --lora-rank {self.rank}")
        for module, (a, b) in adapter.weights.items():
            name_a, name_b = lora_names(self._target(module))
            inputs, outputs = self.arrays[name_a].shape[1], self.arrays[name_b].shape[0]
            if a.shape[1] != inputs or b.shape[0] != outputs:
                raise ArgumentError(
                    f"{adapter.path}: {module}: A {list(a.shape)}, B {list(b.shape)} do not fit the linear "
                    f"[{outputs}, {inputs}]"
                )

    def write(self, slot: int, adapter: LoraAdapter | None) -> None:
        """Put an adapter in `slot` (None: clear it)."""
        if adapter is not None:
            self.check(adapter)
        self.version += 1
        start = slot * self.rank
        for name, array in self.arrays.items():
            if name.startswith(LORA_PREFIXES[0]):
                array[start : start + self.rank] = 0
            else:
                array[:, start : start + self.rank] = 0
        if adapter is None:
            return
        for module, (a, b) in adapter.weights.items():
            name_a, name_b = lora_names(self._target(module))
            self.arrays[name_a][start : start + a.shape[0]] = a
            self.arrays[name_b][:, start : start + a.shape[0]] = b


@dataclass
class _Loaded:
    slot: int
    salt: bytes  # the prefix cache's root for its sequences: KV computed with the adapter differs from the base's
    path: Path


class LoraAdapters:
    """Which adapter each slot of a bank holds, by name. A request takes its adapter's slot for its lifetime; an
    adapter unloaded while requests use it keeps its slot until the last one ends."""

    def __init__(self, bank: LoraBank | None) -> None:
        self.bank = bank
        self.loaded: dict[str, _Loaded] = {}
        self.users = [0] * (bank.slots if bank else 0)  # requests holding each slot
        self._serial = 0

    def names(self) -> list[str]:
        return list(self.loaded)

    def load(self, name: str, adapter: LoraAdapter) -> None:
        """Put an adapter in a free slot under `name`; an ArgumentError when there is none or the name is taken."""
        if self.bank is None:
            raise ArgumentError("this artifact has no adapter slots: compile it with --lora-rank and --max-loras")
        if not name or not isinstance(name, str):
            raise ArgumentError(f"LoRA name {name!r}: expected a non-empty string")
        if name in self.loaded:
            raise ArgumentError(f"LoRA adapter {name!r} is loaded already (unload it first)")
        held = {entry.slot for entry in self.loaded.values()}
        free = [slot for slot in range(self.bank.slots) if slot not in held and self.users[slot] == 0]
        if not free:
            raise ArgumentError(f"all {self.bank.slots} adapter slots are in use (--max-loras): unload one first")
        self.bank.write(free[0], adapter)
        self._serial += 1
        self.loaded[name] = _Loaded(free[0], f"lora:{self._serial}:{name}".encode(), adapter.path)

    def unload(self, name: str) -> bool:
        """Forget an adapter (False: none is loaded under `name`); its slot is cleared once no request holds it."""
        entry = self.loaded.pop(name, None)
        if entry is None:
            return False
        if self.users[entry.slot] == 0:
            self.bank.write(entry.slot, None)
        return True

    def acquire(self, name: str | None) -> tuple[int, bytes]:
        """A request's (slot, prefix-cache salt) for adapter `name` (None: the base model, slot -1)."""
        if name is None:
            return -1, b""
        entry = self.loaded.get(name)
        if entry is None:
            known = ", ".join(self.loaded) or "none"
            raise GenerationError(f"lora {name!r}: no adapter of that name is loaded (loaded: {known})", "lora")
        self.users[entry.slot] += 1
        return entry.slot, entry.salt

    def release(self, slot: int) -> None:
        """A request that held `slot` ended; a slot whose adapter was unloaded meanwhile is cleared."""
        if slot < 0:
            return
        self.users[slot] -= 1
        if self.users[slot] == 0 and slot not in {entry.slot for entry in self.loaded.values()}:
            self.bank.write(slot, None)
