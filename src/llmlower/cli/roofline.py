"""`llmlower roofline`: FLOPs, bytes and step times of pass pipelines against the machine's roofline."""

from __future__ import annotations

import argparse

from ..backends.registry import BACKENDS
from ..errors import LlmlowerError
from .options import MODEL_HELP


def add_roofline_parser(sub: argparse._SubParsersAction) -> None:
    """The `roofline` command and its options."""
    roof = sub.add_parser("roofline", help="FLOPs, bytes and step times of pass pipelines against the roofline")
    roof.add_argument("model", help=MODEL_HELP + " (an artifact: its own pipeline, needs --checkpoint)")
    roof.add_argument("-o", "--output", required=True, help="directory for report.md, report.json and the PNGs")
    roof.add_argument(
        "--pipelines",
        help="';'-separated: baseline (canonicalize + state_cache + kv_cache), fusion (the default pipeline), "
        "WORD+QUANT (e.g. fusion+q4g32); default 'baseline;fusion;fusion+q8;fusion+q4g32'",
    )
    roof.add_argument("--prefill", type=int, default=512, help="prompt tokens of the prefill step (default 512)")
    roof.add_argument("--batch", default="1,16", help="decode batch sizes, comma-separated (default 1,16)")
    roof.add_argument("--context", type=int, default=512, help="cache positions a decode step attends (default 512)")
    roof.add_argument("--backend", choices=list(BACKENDS), help="where steps are timed (default onnx)")
    roof.add_argument(
        "--machine", default="cpu", help="ceilings: cpu or cuda (measured here), a100, h100, h200, l4, rtx4090"
    )
    roof.add_argument("--remeasure", action="store_true", help="measure the ceilings again, not from the cache")
    roof.add_argument("--repeats", type=int, default=5, help="timed runs per step, after a warm-up (default 5)")
    roof.add_argument("--no-measure", action="store_true", help="costs and predictions only, no step times")
    roof.add_argument("--checkpoint", help="for an artifact MODEL: the checkpoint it was compiled from")
    roof.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    roof.set_defaults(run=_roofline)


def _roofline(args: argparse.Namespace) -> int:
    """Cost the pipelines (or an artifact), time their steps, and write the report."""
    from pathlib import Path

    from ..roofline import machine_ceilings
    from ..roofline.report import summary_table, write_report
    from ..roofline.study import StudyOptions, parse_batches, parse_pipelines, run_artifact_study, run_study
    from ..runtime.artifact import is_artifact

    options = StudyOptions(
        prefill=args.prefill,
        batches=parse_batches(args.batch),
        context=args.context,
        backend=args.backend or "onnx",
        repeats=args.repeats,
        measure=not args.no_measure,
    )
    if is_artifact(args.model):
        given = [flag for flag, value in (("--pipelines", args.pipelines), ("--backend", args.backend)) if value]
        if given:
            raise LlmlowerError(f"{args.model} is a compiled artifact: {', '.join(given)} come from its manifest")
        ceilings = machine_ceilings(args.machine, remeasure=args.remeasure)
        report = run_artifact_study(Path(args.model), args.checkpoint, options, ceilings)
    else:
        pipelines = args.pipelines or "baseline;fusion;fusion+q8;fusion+q4g32"
        parse_pipelines(pipelines)  # bad words fail before measuring or loading anything
        ceilings = machine_ceilings(args.machine, remeasure=args.remeasure)
        report = run_study(args.model, pipelines, options, ceilings, dtype=args.dtype)
    path = write_report(report, Path(args.output))
    print("\n".join(summary_table(report)))
    print(f"\n{path} (+ report.json, roofline.png, time_by_kind.png)")
    return 0
