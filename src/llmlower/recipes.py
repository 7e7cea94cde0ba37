"""The named recipes a model is compiled with (backend, quantization, scales, KV cache dtype), each with the
machines it is for and its measured quality, and `auto`: the fastest recipe within QUALITY_GATE of fp32 on held-out
text for this machine's CPU and the backends installed. The command line, the Python API, the compile cache, the
benchmarks and the docs' table read this module (plain Python: no torch)."""

from __future__ import annotations

import platform
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from .backends.registry import BACKENDS, get_backend
from .errors import ArgumentError
from .runtime.cpu_features import host_cpu_flags

AUTO = "auto"
QUALITY_GATE = 5.0  # most % perplexity over fp32, on every held-out text, that a recipe `auto` picks may cost
# the texts quality is measured on (tests/data): `heldout` is the one recipes were chosen on, `unseen` is not
QUALITY_TEXTS = ("heldout", "unseen")
QUANT_FLAGS = ("quant", "gptq", "awq", "scale_dtype", "lm_head_bits")  # the settings --quant's group replaces


@dataclass(frozen=True)
class Recipe:
    """A named set of compile settings. `machines`: the CPU flags (as Linux lists them) its kernels need to lead,
    any one set of them ((): any CPU); `quality`: its measured perplexity over fp32, in %, per held-out text, scored
    on the artifact one token a step (benchmarks/recipe_quality.py); `speed`: what it was measured at, for the docs."""

    name: str
    summary: str
    backend: str
    quant: str = "none"
    gptq: bool = False
    awq: bool = False
    scale_dtype: str | None = None
    lm_head_bits: int | None = None
    kv_cache_dtype: str = "auto"
    machines: tuple[frozenset[str], ...] = ()
    quality: Mapping[str, float] = field(default_factory=dict)
    speed: str = ""

    @property
    def settings(self) -> dict[str, Any]:
        """The compile settings it names (the flags' names, as argparse stores them)."""
        return {name: getattr(self, name) for name in recipe_settings()}

    @property
    def pipeline_options(self) -> dict[str, Any]:
        """Its build_pipeline options: the quantization settings (QUANT_FLAGS) it sets."""
        return {name: getattr(self, name) for name in QUANT_FLAGS if getattr(self, name)}

    @property
    def flags(self) -> str:
        """The command-line flags that spell it out."""
        words = [f"--backend {self.backend}", f"--quant {self.quant}"]
        words += ["--gptq"] * self.gptq + ["--awq"] * self.awq
        if self.scale_dtype:
            words.append(f"--scale-dtype {self.scale_dtype}")
        if self.lm_head_bits:
            words.append(f"--lm-head-bits {self.lm_head_bits}")
        if self.kv_cache_dtype != "auto":
            words.append(f"--kv-cache-dtype {self.kv_cache_dtype}")
        return " ".join(words)

    @property
    def worst_quality(self) -> float:
        """Its largest perplexity increase over the held-out texts (0 for an unquantized recipe)."""
        return max(self.quality.values(), default=0.0)

    def runs_well_on(self, flags: set[str] | None) -> bool:
        """Whether a CPU with `flags` has what its kernels need (unknown flags: only recipes for any CPU)."""
        if not self.machines:
            return True
        return flags is not None and any(needed <= flags for needed in self.machines)


def recipe_settings() -> tuple[str, ...]:
    """The settings a recipe names: the backend, the quantization (QUANT_FLAGS) and the KV cache dtype."""
    return ("backend", *QUANT_FLAGS, "kv_cache_dtype")


X86_INT8 = (frozenset({"avx2"}),)  # TVM's int8 matmuls: VNNI, AMX tiles or AVX2's pmaddubsw (backends/tvm/int8_dot)

# fastest first: `auto` takes the first that this machine runs well, with its backend installed, inside the gate
RECIPES: dict[str, Recipe] = {
    recipe.name: recipe
    for recipe in (
        Recipe(
            name="fast",
            summary="TVM's int8/int4 kernels: int4 for the MLP's gate/up, int8 with int8 activations elsewhere",
            backend="tvm",
            quant="q4mlp-a8",
            gptq=True,
            scale_dtype="float16",
            kv_cache_dtype="float16",
            machines=X86_INT8,
            quality={"heldout": 3.2, "unseen": 4.1},
        ),
        Recipe(
            name="balanced",
            summary="TVM's int8 kernels throughout, in groups of 32: near fp32's quality, 1.3x the bytes of fast",
            backend="tvm",
            quant="q8",
            scale_dtype="float16",
            kv_cache_dtype="float16",
            machines=X86_INT8,
            quality={"heldout": 0.6, "unseen": 1.2},
        ),
        Recipe(
            name="portable",
            summary="ONNX Runtime's MatMulNBits on any CPU (ARM's dotprod and i8mm included)",
            backend="onnx",
            quant="q4mix",
            gptq=True,
            quality={"heldout": 3.0, "unseen": 4.3},
        ),
        Recipe(
            name="exact",
            summary="fp32 on ONNX Runtime: transformers' own numbers",
            backend="onnx",
        ),
    )
}


@dataclass(frozen=True)
class Choice:
    """A recipe as asked for (`asked`: a name or auto), the settings compiled with (its own, with the explicit flags
    in their place), and why: recorded in the artifact's manifest."""

    asked: str
    recipe: str
    settings: dict[str, Any]
    overridden: tuple[str, ...]
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "overridden": list(self.overridden)}

    def line(self) -> str:
        """One line for the terminal: what was chosen and why."""
        asked = f"recipe {self.asked} -> {self.recipe}" if self.asked != self.recipe else f"recipe {self.recipe}"
        return f"{asked}: {self.reason}"


def machine_flags() -> set[str] | None:
    """This CPU's flags as Linux lists them; None where unknown (then only recipes for any CPU are picked)."""
    return host_cpu_flags()


def describe_cpu(flags: set[str] | None) -> str:
    """The features recipes are chosen by, as this CPU has them."""
    if flags is None:
        return f"{platform.machine()}, features unknown"
    named = ("avx2", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_int8", "asimddp", "i8mm")
    present = [flag for flag in named if flag in flags]
    return f"{platform.machine()} with {', '.join(present) if present else 'none of ' + ', '.join(named)}"


def pick_auto(
    backend: str | None = None, flags: set[str] | None = None, installed: set[str] | None = None
) -> tuple[Recipe, str]:
    """The fastest recipe (RECIPES' order) for `backend` (any when None) that this CPU runs well, whose backend is
    installed and whose quality is inside QUALITY_GATE; and why, naming the faster ones passed over."""
    installed = {name for name, b in BACKENDS.items() if b.installed} if installed is None else installed
    passed: list[str] = []
    for recipe in RECIPES.values():
        if backend is not None and recipe.backend != backend:
            continue
        if recipe.backend not in installed:
            passed.append(f"{recipe.name} needs the {recipe.backend} backend, not installed")
        elif not recipe.runs_well_on(flags):
            needs = " or ".join("+".join(sorted(m)) for m in recipe.machines)
            passed.append(f"{recipe.name} needs a CPU with {needs}")
        elif recipe.worst_quality > QUALITY_GATE:
            passed.append(f"{recipe.name} costs +{recipe.worst_quality}% perplexity, over +{QUALITY_GATE:g}%")
        else:
            quality = (
                f"+{recipe.worst_quality}% perplexity over fp32 at most on held-out text" if recipe.quality else "fp32"
            )
            why = f"the fastest recipe for {describe_cpu(flags)} with {recipe.backend} installed ({quality})"
            return recipe, "; ".join([why, *passed])
    exact = RECIPES["exact"]
    if backend is None or backend == exact.backend:
        return exact, "; ".join(["no faster recipe runs here", *passed])
    # a backend none of whose recipes runs here (torch and mlir have none): exact's settings on it
    why = f"no recipe is measured on {backend}" if not passed else f"no {backend} recipe runs here"
    return Recipe("exact", exact.summary, backend), "; ".join([f"{why}: unquantized", *passed])


def choose(asked: str | None, given: Mapping[str, Any], flags: set[str] | None = None) -> Choice:
    """The settings a command compiles with: recipe `asked` (None: auto), with the settings given explicitly
    (`given`: backend, quant, gptq, ... as argparse names them; None or absent: not given) in their place; a given
    --quant replaces the recipe's whole quantization (QUANT_FLAGS). Auto with a given backend picks among its
    recipes."""
    asked = asked or AUTO
    given = {name: value for name, value in given.items() if value not in (None, False)}
    if asked == AUTO:
        recipe, reason = pick_auto(given.get("backend"), machine_flags() if flags is None else flags)
    elif asked in RECIPES:
        recipe = RECIPES[asked]
        reason = recipe.summary
        if given.get("backend") is not None:
            get_backend(given["backend"])  # an unknown backend is refused by name
    else:
        raise ArgumentError(f"--recipe {asked!r}: one of {AUTO}, {', '.join(RECIPES)}")
    settings = recipe.settings
    if "quant" in given:
        settings.update({name: None for name in QUANT_FLAGS}, gptq=False, awq=False)
    settings.update(given)
    overridden = tuple(name for name in given if recipe.settings.get(name) != given[name])
    if overridden:
        reason += f"; given explicitly: {', '.join('--' + name.replace('_', '-') for name in overridden)}"
    return Choice(asked, recipe.name, settings, overridden, reason)
