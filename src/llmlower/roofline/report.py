"""Write a study's report: report.json (the report dict), report.md (tables) and the PNG plots."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .plot import plot_kinds, plot_roofline

ROOFLINE_PNG, KINDS_PNG = "roofline.png", "time_by_kind.png"


def _state_note(report: dict[str, Any]) -> str:
    """A hybrid model's recurrent state, which every decode step reads and writes whatever the context."""
    state = report.get("state_bytes_per_sequence", 0)
    return f"; recurrent state: {state:,} bytes per sequence, whatever its length" if state else ""


def _ms(seconds: float | None) -> str:
    return "–" if seconds is None else f"{seconds * 1000:,.1f}"


def _percent(phase: dict[str, Any]) -> str:
    """% of roofline, marked when the step was measured above its roof."""
    if phase["roofline_pct"] is None:
        return "–"
    return f"{phase['roofline_pct']:.0f}%" + (" ⚠ above roof" if phase["above_roof"] else "")


def above_roof_warning(report: dict[str, Any]) -> list[str]:
    """A warning naming the steps measured above their roofs and what to do; nothing when there are none."""
    flagged = report["above_roof"]
    return [] if flagged is None else ["", f"⚠ {'; '.join(flagged['steps'])}: {flagged['note']}"]


def summary_table(report: dict[str, Any]) -> list[str]:
    """One row per pipeline and phase: work, intensity, roofline prediction, measurement; then the warning
    about steps measured above their roofs, if any."""
    rows = [
        "| pipeline | phase | GFLOP | MB moved (weights / KV read) | FLOP/byte | bound | predicted ms | "
        "measured ms | % of roofline |",
        "|---|---|---:|---:|---:|---|---:|---:|---:|",
    ]
    for pipeline in report["pipelines"]:
        for ph in pipeline["phases"]:
            rows.append(
                f"| {pipeline['name']} | {ph['label']} | {ph['flops'] / 1e9:,.2f} | {ph['bytes'] / 1e6:,.1f} "
                f"({ph['weight_bytes'] / 1e6:,.1f} / {ph['kv_read_bytes'] / 1e6:,.1f}) | {ph['intensity']:.2f} | "
                f"{ph['bound']} | {_ms(ph['predicted_s'])} | {_ms(ph['measured_s'])} | {_percent(ph)} |"
            )
    return rows + above_roof_warning(report)


def _top_ops(report: dict[str, Any]) -> list[str]:
    lines = []
    for pipeline in report["pipelines"]:
        for ph in pipeline["phases"]:
            lines += [
                f"**{pipeline['name']}, {ph['label']}**",
                "",
                "| op (module) | kind | nodes | GFLOP | MB | predicted ms |",
                "|---|---|---:|---:|---:|---:|",
            ]
            for op in ph["top_ops"]:
                lines.append(
                    f"| `{op['op']}` | {op['kind']} | {op['count']} | {op['flops'] / 1e9:,.3f} | "
                    f"{op['bytes'] / 1e6:,.1f} | {_ms(op['predicted_s'])} |"
                )
            lines.append("")
    return lines


def _op_roofs(report: dict[str, Any]) -> str:
    """Which ops computed at another roof than the model dtype's (ONNX Runtime's int8 MatMulNBits)."""
    roofs = {op: peak for p in report["pipelines"] for op, peak in p["op_peaks"].items()}
    if not roofs:
        return f"all at the {report['dtype']} roof"
    named = ", ".join(f"{op} at {peak / 1e9:,.1f} GOP/s" for op, peak in roofs.items())
    return f"{named} (int8 MatMulNBits), the rest at the {report['dtype']} roof"


def markdown(report: dict[str, Any]) -> str:
    machine = report["machine"]
    roofs = ", ".join(f"{k} {v / 1e9:,.1f} GFLOP/s" for k, v in machine["flops"].items())
    timing = f"median of {report['repeats']} runs after a warm-up" if report["repeats"] else "not measured"
    lines = [
        f"# Roofline: {report['model']} ({report['architecture']}, {report['dtype']})",
        "",
        f"Machine: {machine['description']} ({machine['source']}): {roofs}; memory "
        f"{machine['bandwidth'] / 1e9:,.1f} GB/s; ridge point {machine['ridge']:.1f} FLOP/byte.",
        f"Backend: {report['backend']}; step times {timing}. KV cache: {report['kv_bytes_per_token']:,} bytes "
        f"per token{_state_note(report)}.",
        "Predicted = max(FLOPs / peak, bytes / bandwidth) of the whole step, each op's FLOPs at its own peak "
        f"({_op_roofs(report)}); % of roofline = predicted / measured.",
        "",
        *summary_table(report),
        "",
        f"![roofline]({ROOFLINE_PNG})",
        "",
        f"![predicted time by op kind]({KINDS_PNG})",
        "",
        "## Top ops by predicted time (each op at its own roof)",
        "",
        *_top_ops(report),
    ]
    return "\n".join(lines)


def write_report(report: dict[str, Any], directory: Path) -> Path:
    """report.json, report.md and the two PNGs in `directory`; returns report.md's path."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "report.json").write_text(json.dumps(report, indent=2), encoding="utf-8")
    plot_roofline(report, directory / ROOFLINE_PNG)
    plot_kinds(report, directory / KINDS_PNG)
    path = directory / "report.md"
    path.write_text(markdown(report), encoding="utf-8")
    return path
