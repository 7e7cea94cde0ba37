"""An artifact's weights: the tensors its manifest lists (`weights.tensors`: name, shape and dtype, in the order
the step function takes them), read from the artifact's weights file or, for speed runs where the weights
cannot travel, made up (weights="random", vLLM's `--load-format dummy`).

Random weights come from a generator seeded by (seed, tensor name), so the same seed gives the same weights
whatever order tensors are made in. Floating tensors are uniform in [-RANDOM_RANGE, RANDOM_RANGE] (vLLM's
range), integer ones (packed int4/int8 weights, zero points) uniform over their dtype: a dequantized weight is
then at most 255 x RANDOM_RANGE, norms and activations stay small and finite, and the step does the same work
as with real weights.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ArgumentError
from .artifact import MANIFEST, ArtifactError

WEIGHT_SOURCES = {
    "auto": "the artifact's weights file",
    "random": "made up from a seeded generator (dummy weights for speed runs)",
}
RANDOM_RANGE = 1e-3


@dataclass(frozen=True)
class WeightSpec:
    """One weight as the manifest lists it."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype.name}


def tensor_spec(name: str, array: Any) -> dict[str, Any]:
    """The manifest entry of a weight (anything with a shape and a numpy dtype), written when compiling."""
    return WeightSpec(name, tuple(int(d) for d in array.shape), np.dtype(array.dtype)).to_dict()


@dataclass(frozen=True)
class WeightSource:
    """Where Engine.load takes an artifact's weights from: "auto" (its weights file) or "random" (made up from
    `seed`, for speed runs; the weights file may then be absent)."""

    kind: str = "auto"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in WEIGHT_SOURCES:
            choices = "; ".join(f"{name!r}: {meaning}" for name, meaning in WEIGHT_SOURCES.items())
            raise ArgumentError(f"weights={self.kind!r}: expected one of {choices}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ArgumentError(f"weights_seed={self.seed!r}: expected an integer >= 0")

    @property
    def random(self) -> bool:
        return self.kind == "random"

    def arrays(self, artifact: Path, manifest: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """Every weight the manifest lists, in its order: from the weights file (safetensors), or made up."""
        specs = tensor_specs(artifact, manifest)
        if self.random:
            return random_weights(specs, self.seed)
        import safetensors.numpy

        path = artifact / manifest["weights"]["file"]
        stored = safetensors.numpy.load_file(str(path))
        for spec in specs:
            array = stored.get(spec.name)
            if array is None or array.shape != spec.shape or array.dtype != spec.dtype:
                found = "missing" if array is None else f"{array.dtype.name} {list(array.shape)}"
                raise ArtifactError(f"{path}: weight {spec.name!r} is {found}; {MANIFEST} lists {spec.to_dict()}")
        return {spec.name: stored[spec.name] for spec in specs}

    def made_up(self, artifact: Path, manifest: Mapping[str, Any]) -> dict[str, np.ndarray] | None:
        """The made-up weights, for a backend that reads the weights file itself (ONNX Runtime's external data)
        and takes these in its place; None when the file is to be read."""
        return self.arrays(artifact, manifest) if self.random else None


ARTIFACT_WEIGHTS = WeightSource()  # the default: the artifact's own weights file


def tensor_specs(artifact: Path, manifest: Mapping[str, Any]) -> list[WeightSpec]:
    """The weights `manifest` lists (field weights.tensors), checked: names, non-negative integer shapes and
    dtypes numpy knows."""
    where = f"{artifact / MANIFEST}: weights.tensors"
    entries = (manifest.get("weights") or {}).get("tensors")
    if not isinstance(entries, list):
        raise ArtifactError(f"{where}: missing or not a list of {{name, shape, dtype}}")
    specs = []
    for index, entry in enumerate(entries):
        try:
            name, shape, dtype = entry["name"], entry["shape"], np.dtype(entry["dtype"])
            if not isinstance(name, str) or not all(isinstance(d, int) and d >= 0 for d in shape):
                raise ValueError
        except (TypeError, KeyError, ValueError):
            raise ArtifactError(f"{where}[{index}]: expected {{name, shape, dtype}}, found {entry!r}") from None
        specs.append(WeightSpec(name, tuple(shape), dtype))
    return specs


def random_tensor(spec: WeightSpec, seed: int) -> np.ndarray:
    """The made-up values of one weight: the same for the same (seed, name)."""
    rng = np.random.default_rng([seed, zlib.crc32(spec.name.encode())])
    if spec.dtype.kind == "f":
        values = rng.random(spec.shape, dtype=np.float32)
        values *= np.float32(2 * RANDOM_RANGE)
        values -= np.float32(RANDOM_RANGE)
        return values.astype(spec.dtype, copy=False)
    if spec.dtype.kind in "iu":
        limits = np.iinfo(spec.dtype)
        return rng.integers(limits.min, limits.max, spec.shape, dtype=spec.dtype, endpoint=True)
    raise ArtifactError(f"weight {spec.name!r}: cannot make up values of dtype {spec.dtype.name}")


def random_weights(specs: list[WeightSpec], seed: int) -> dict[str, np.ndarray]:
    """Made-up values of every weight, in the manifest's order."""
    return {spec.name: random_tensor(spec, seed) for spec in specs}
