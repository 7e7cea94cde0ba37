"""`llmlower generate` (one prompt's completions) and `llmlower chat` (an interactive chat in the terminal)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from rich.console import Console

from ..errors import LlmlowerError
from .engine_args import engine_from_args, sampling_params
from .options import MODEL_HELP, add_engine_options


def add_generate_parser(sub: argparse._SubParsersAction) -> None:
    """The `generate` command and its options."""
    gen = sub.add_parser("generate", help="generate a completion for one prompt (greedy unless --temperature)")
    gen.add_argument("model", help=MODEL_HELP)
    gen.add_argument("--prompt", required=True, help="the user message (or raw text with --raw)")
    gen.add_argument("--raw", action="store_true", help="do not apply the model's chat template")
    gen.add_argument("--stream", action="store_true", help="print the text as it is generated")
    gen.add_argument(
        "--json", action="store_true", help="print the result as JSON (text, ids, logprobs, usage, timing)"
    )
    add_engine_options(gen)
    gen.set_defaults(run=_generate)


def add_chat_parser(sub: argparse._SubParsersAction) -> None:
    """The `chat` command and its options."""
    chat = sub.add_parser("chat", help="an interactive chat in the terminal, replies streamed")
    chat.add_argument("model", help=MODEL_HELP)
    chat.add_argument("--system", help="a system message to start the conversation with")
    add_engine_options(chat)
    chat.set_defaults(run=_chat)


def _generate(args: argparse.Namespace) -> int:
    """Print the completions of --prompt (streamed with --stream, as JSON with --json)."""
    params = sampling_params(args)  # bad values fail before the model loads
    engine = engine_from_args(args, sequences=params.n)
    if args.stream:
        for delta in engine.stream([args.prompt], params, chat=not args.raw):
            print(delta.text, end="\n\n" if delta.finish_reason and params.n > 1 else "", flush=True)
        print()
        return 0
    results = engine.generate([args.prompt], params, chat=not args.raw)
    if args.json:
        payloads = [result.to_dict() for result in results]
        print(json.dumps(payloads[0] if len(payloads) == 1 else payloads, ensure_ascii=False))
        return 0
    err = Console(stderr=True)
    for result in results:
        print(result.text)
        err.print(
            f"[dim]{len(result.token_ids)} tokens, finish_reason={result.finish_reason}, "
            f"TTFT {result.timing.ttft_s * 1000:.0f} ms, decode {result.timing.decode_tokens_per_s:.1f} tokens/s"
            + _speculation_summary(result.speculation)
            + "[/dim]"
        )
    return 0


def _speculation_summary(speculation: dict[str, Any] | None) -> str:
    """A completion's speculation counts for its summary line (empty without speculative decoding)."""
    if not speculation:
        return ""
    return (
        f", speculation: {speculation['accepted_tokens']}/{speculation['proposed_tokens']} proposed tokens accepted, "
        f"{speculation['mean_accepted_length']:.2f} tokens per step"
    )


def _chat(args: argparse.Namespace) -> int:
    """An interactive chat in the terminal: each reply streams as it is generated; /reset, /exit."""
    from dataclasses import replace

    params = sampling_params(args)
    if params.n != 1:
        raise LlmlowerError("chat: n must be 1")
    engine = engine_from_args(args, sequences=1)
    console = Console(stderr=True)
    console.print(f"[dim]chatting with {args.model} ({'greedy' if params.greedy else 'sampling'}); /reset, /exit[/dim]")
    messages = [{"role": "system", "content": args.system}] if args.system else []
    turn = 0
    while True:
        try:
            line = input("> ")
        except EOFError:
            return 0
        if line.strip() == "/exit":
            return 0
        if line.strip() == "/reset":
            messages = messages[:1] if args.system else []
            continue
        messages.append({"role": "user", "content": line})
        reply = []
        seeded = replace(params, seed=None if params.seed is None else params.seed + turn)
        for delta in engine.stream([messages], seeded):
            print(delta.text, end="", flush=True)
            reply.append(delta.text)
        print()
        messages.append({"role": "assistant", "content": "".join(reply)})
        turn += 1
