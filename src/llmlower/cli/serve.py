"""`llmlower serve`: an OpenAI-compatible HTTP server on one engine, or on Ray Serve replicas."""

from __future__ import annotations

import argparse

from ..errors import LlmlowerError
from ..serve.limits import RequestLimits, limit_flags
from .engine_args import engine_config, engine_from_args
from .options import MODEL_HELP, add_serving_options, parse_bytes

SERVE_SEQUENCES = 16  # the server's max_num_seqs unless --max-num-seqs
LIMIT_FLAGS = limit_flags()  # serve's per-request limits: (name, default, help)


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    """The `serve` command and its options."""
    srv = sub.add_parser(
        "serve",
        help="an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions); an artifact is code that "
        "runs in the server (TVM's model.so, MLIR modules): serve only artifacts you trust",
    )
    srv.add_argument("model", help=MODEL_HELP)
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    srv.add_argument("--port", type=parse_port, default=8000, help="TCP port, 1-65535 (default 8000)")
    srv.add_argument("--api-key", help="clients must send 'Authorization: Bearer KEY' (default: $LLMLOWER_API_KEY)")
    srv.add_argument("--served-model-name", help="the model's name in the API (default: the artifact's directory name)")
    srv.add_argument("--max-waiting", type=int, default=256, help="sequences waiting before new requests get 429")
    srv.add_argument("--max-body-bytes", type=parse_bytes, default=4 << 20, help="larger request bodies get 413")
    srv.add_argument("--drain-timeout", type=int, default=30, help="seconds running requests get after SIGTERM")
    srv.add_argument(
        "--request-timeout",
        type=float,
        default=600,
        help="seconds a request may run before it is aborted (0: no limit; default 600)",
    )
    for flag, default, what in LIMIT_FLAGS:
        srv.add_argument(f"--{flag.replace('_', '-')}", type=int, default=default, help=f"{what} (default {default})")
    srv.add_argument(
        "--enable-lora-loading",
        action="store_true",
        help="serve /v1/load_lora_adapter and /v1/unload_lora_adapter: clients with the key load adapters from "
        "this machine's paths (the model needs adapter slots: --lora-rank)",
    )
    srv.add_argument(
        "--replicas", type=int, default=1, help="N replicas on Ray Serve, each its own engine (artifacts; RAY_ADDRESS)"
    )
    add_serving_options(srv, f"{SERVE_SEQUENCES}")
    srv.set_defaults(run=_serve)


def parse_port(text: str) -> int:
    """A TCP port, 1-65535."""
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"expected a TCP port, 1-65535, got {text!r}")
    return int(text)


def _serve(args: argparse.Namespace) -> int:
    """Load the model (an artifact needs no torch), then serve it until SIGTERM."""
    import os
    from pathlib import Path

    try:
        from ..serve import ServerConfig, run
    except ImportError as error:
        raise LlmlowerError(f"serve needs the serve extra (pip install 'llmlower[serve]'): {error}") from None
    name = args.served_model_name or Path(str(args.model).rstrip("/")).name
    api_key = args.api_key or os.environ.get("LLMLOWER_API_KEY")
    limits = RequestLimits(**{flag: getattr(args, flag) for flag, _, _ in LIMIT_FLAGS})
    timeout = args.request_timeout or None
    config = ServerConfig(
        name, api_key, args.max_waiting, args.max_body_bytes, limits, timeout, lora_loading=args.enable_lora_loading
    )
    if args.replicas > 1:
        if args.loras or args.enable_lora_loading:
            raise LlmlowerError("--lora and --enable-lora-loading serve one engine: not with --replicas")
        try:
            from ..serve.replicas import run_replicas
        except ImportError as error:
            message = f"--replicas needs the replicas extra (pip install 'llmlower[replicas]'): {error}"
            raise LlmlowerError(message) from None
        options = {"host": args.host, "port": args.port, "threads": args.threads, "drain_timeout": args.drain_timeout}
        run_replicas(args.model, engine_config(args, SERVE_SEQUENCES), config, args.replicas, **options)
        return 0
    engine = engine_from_args(args, sequences=SERVE_SEQUENCES)
    run(engine, config, host=args.host, port=args.port, drain_timeout=args.drain_timeout)
    return 0
