"""The artifacts tests/runtime runs, compiled by the main environment (torch and the compiler) for the runtime's
own environment, which has neither (make test-runtime): `python tests/runtime/prepare.py DIR`."""

from __future__ import annotations

import shutil
import sys
from collections.abc import Callable
from pathlib import Path

from llmlower.locks import locked

DATA = Path(__file__).parent.parent / "data"
TOOL_MARKERS = ["<tool_call>", "</tool_call>"]  # tokens of their own, as in tokenizers of models with such templates

# name -> (tiny architecture, changes to its config, `llmlower compile` flags, a chat template in tests/data or None)
ARTIFACTS: dict[str, tuple[str, dict[str, object], tuple[str, ...], str | None]] = {
    # room for 1,024 positions: long enough that a served request outlives its client's disconnect
    "long-llama-onnx": ("llama", {"max_position_embeddings": 1024}, ("--recipe", "exact"), None),
    # a template that presents tools and writes calls in <tool_call> tags (each tag a token of the vocabulary)
    "tools-llama-onnx": ("llama", {"max_position_embeddings": 2048}, ("--recipe", "exact"), "hermes_tools.jinja"),
}


def build_once(entry: Path, build: Callable[[Path], object]) -> Path:
    """`entry`, built by build(staging) and renamed into place by the first process to ask for it; the others
    wait on its lock, then find it built."""
    with locked(entry, exclusive=True, notify=lambda message: None):
        if not entry.exists():
            staging = entry.with_name(f".{entry.name}.staging")
            shutil.rmtree(staging, ignore_errors=True)
            build(staging)
            staging.rename(entry)
    return entry


def prepare(root: Path, name: str) -> Path:
    """root/name: ARTIFACTS[name]'s tiny checkpoint written and compiled, unless already there."""
    arch, config, flags, template = ARTIFACTS[name]

    def build(out: Path) -> None:
        import tokenizers

        from llmlower.cli import main
        from llmlower.testing import VOCAB, write_tiny_checkpoint

        markers = {"vocab_size": VOCAB + len(TOOL_MARKERS)} if template is not None else {}
        checkpoint = write_tiny_checkpoint(arch, root / ".checkpoints" / name, **config, **markers)
        if template is not None:
            (checkpoint / "chat_template.jinja").write_text((DATA / template).read_text())
            tokenizer = tokenizers.Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
            tokenizer.add_tokens(TOOL_MARKERS)
            tokenizer.save(str(checkpoint / "tokenizer.json"))
        assert main(["compile", str(checkpoint), "-o", str(out), *flags]) == 0

    return build_once(root / name, build)


if __name__ == "__main__":
    for artifact in ARTIFACTS:
        print(prepare(Path(sys.argv[1]), artifact))
