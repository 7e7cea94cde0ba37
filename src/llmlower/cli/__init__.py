"""The `llmlower` command: generate, chat, compile, perplexity, inspect, roofline, serve, passes; one module per
command (or pair), the options they share in options.py and what those options build in engine_args.py."""

from __future__ import annotations

import argparse
import sys

from rich.console import Console

from .. import progress
from ..errors import LlmlowerError
from .compile import add_compile_parser
from .generate import add_chat_parser, add_generate_parser
from .inspect import add_inspect_parser, add_passes_parser
from .perplexity import add_perplexity_parser
from .roofline import add_roofline_parser
from .serve import LIMIT_FLAGS, add_serve_parser


class RichReporter:
    """Shows each stage as a spinner while it runs and a line with its time when it is done (stderr)."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self._status = None

    def start(self, description: str) -> None:
        if self._status is None and self.console.is_terminal:
            self._status = self.console.status(description)
            self._status.start()

    def finish(self, description: str, seconds: float, detail: str) -> None:
        if self._status is not None:
            self._status.stop()
            self._status = None
        suffix = f" [dim]{detail}[/dim]" if detail else ""
        self.console.print(f"[green]✓[/green] {description} ({seconds:.1f}s){suffix}", highlight=False)


def build_parser() -> argparse.ArgumentParser:
    """The `llmlower` argument parser, every command's options included (the docs' CLI reference is made from it)."""
    parser = argparse.ArgumentParser(prog="llmlower", description="Compile and run Transformer LLMs.")
    sub = parser.add_subparsers(dest="command", required=True)
    for add_parser in (
        add_generate_parser,
        add_chat_parser,
        add_compile_parser,
        add_perplexity_parser,
        add_inspect_parser,
        add_roofline_parser,
        add_serve_parser,
        add_passes_parser,
    ):
        add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the `llmlower` command with `argv` (default: sys.argv); its exit status. Errors are one line."""
    args = build_parser().parse_args(argv)
    lowest = {
        "replicas": 1,
        "max_waiting": 0,
        "max_body_bytes": 1,
        "drain_timeout": 0,
        "request_timeout": 0,
        **{flag: 1 if flag == "max_n" else 0 for flag, _, _ in LIMIT_FLAGS},
        "max_context": 1,
        "max_num_seqs": 1,
        "max_num_batched_tokens": 1,
        "block_size": 1,
        "num_blocks": 1,
        "kv_cache_memory": 1,
        "context": 1,
        "batch": 1,
        "window": 1,
        "stride": 1,
        "threads": 0,
        "prefill": 1,
        "repeats": 1,
    }
    for name, bound in lowest.items():
        value = getattr(args, name, None)
        if isinstance(value, int | float) and value < bound:
            print(f"error: --{name.replace('_', '-')} must be >= {bound}, got {value}", file=sys.stderr)
            return 2
    progress.use_reporter(RichReporter(Console(stderr=True)))
    try:
        return args.run(args)
    except LlmlowerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        progress.use_reporter(None)
