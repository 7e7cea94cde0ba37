"""PNG plots of a report dict: the roofline with one point per pipeline and phase, and predicted time by op
kind per pipeline. Each function returns what it drew, read back from the figure, so it can be checked
against the report. A step measured above its roof is drawn on its roof, edged in red with its % of roofline
written beside it, never silently above the roof."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.figure import Figure  # without pyplot: no display, no global figure state

from .cost import KINDS

MARKERS = "os^Dv<>ph*"
WARNING = "red"


def point_performance(phase: dict[str, Any]) -> float:
    """FLOP/s a phase reached: measured when timed, else the roofline's prediction."""
    seconds = phase["measured_s"] if phase["measured_s"] is not None else phase["predicted_s"]
    return phase["flops"] / seconds


def roof_performance(phase: dict[str, Any]) -> float:
    """FLOP/s of the phase's roof at its intensity: its FLOPs in its predicted time."""
    return phase["flops"] / phase["predicted_s"]


def _flag_above_roof(ax: Any, phase: dict[str, Any], at: tuple[float, float]) -> str:
    """Write a step's % of roofline in red next to its clipped point; returns the text written."""
    text = f"{phase['roofline_pct']:.0f}% of roof: re-measure the ceilings"
    return ax.annotate(text, at, xytext=(6, -10), textcoords="offset points", color=WARNING, fontsize=7).get_text()


def plot_roofline(report: dict[str, Any], path: Path) -> list[dict[str, Any]]:
    """Log-log roofline of the machine (memory roof, one compute roof per precision) with a point per
    pipeline and phase at (arithmetic intensity, FLOP/s reached). Returns the points drawn."""
    machine = report["machine"]
    intensities = [ph["intensity"] for p in report["pipelines"] for ph in p["phases"]]
    x = np.logspace(np.log10(min(intensities) / 4), np.log10(max(intensities) * 4), 200)
    fig = Figure(figsize=(8, 5.5))
    ax = fig.subplots()
    for precision, peak in sorted(machine["flops"].items(), key=lambda kv: -kv[1]):
        roof = np.minimum(peak, x * machine["bandwidth"])
        ax.plot(
            x, roof, color="black", lw=2 if peak == machine["peak"] else 1, ls="-" if peak == machine["peak"] else ":"
        )
        ax.annotate(f"{precision} {peak / 1e9:,.1f} GFLOP/s", (x[-1], peak), ha="right", va="bottom", fontsize=8)
    points = [(i, j, p, ph) for i, p in enumerate(report["pipelines"]) for j, ph in enumerate(p["phases"])]
    notes = {}
    for i, j, pipeline, phase in points:
        at = (phase["intensity"], min(point_performance(phase), roof_performance(phase)))
        ax.scatter(
            [at[0]],
            [at[1]],
            color=f"C{i}",
            marker=MARKERS[j % len(MARKERS)],
            s=60,
            edgecolors=WARNING if phase["above_roof"] else "none",
            linewidths=2,
            label=f"{pipeline['name']}: {phase['label']}",
        )
        if phase["above_roof"]:
            notes[i, j] = _flag_above_roof(ax, phase, at)
    drawn = []
    for collection, (i, j, pipeline, phase) in zip(ax.collections, points, strict=True):
        (xy,) = collection.get_offsets()
        drawn.append(
            {
                "pipeline": pipeline["name"],
                "phase": phase["label"],
                "intensity": float(xy[0]),
                "flops_per_s": float(xy[1]),
                "above_roof_note": notes.get((i, j)),
            }
        )
    ax.legend(fontsize=7, loc="upper left")
    measured = "measured" if report["repeats"] else "predicted"
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="arithmetic intensity (FLOP / byte)",
        ylabel=f"FLOP/s ({measured})",
        title=f"{report['architecture']} on {machine['description']} ({report['backend']}); "
        f"{machine['bandwidth'] / 1e9:,.1f} GB/s",
    )
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return drawn


def plot_kinds(report: dict[str, Any], path: Path) -> dict[str, dict[str, dict[str, float]]]:
    """Per phase, a stacked bar per pipeline of the roofline time predicted for each op kind (each op at its
    own roof). Returns {phase label: {pipeline: {kind: seconds}}} as drawn."""
    labels = [ph["label"] for ph in report["pipelines"][0]["phases"]]
    names = [p["name"] for p in report["pipelines"]]
    fig = Figure(figsize=(4.5 * len(labels), 4.5))
    axes = fig.subplots(1, len(labels), squeeze=False)
    drawn: dict[str, dict[str, dict[str, float]]] = {}
    for ax, (column, label) in zip(axes[0], enumerate(labels), strict=True):
        bottom = np.zeros(len(names))
        bars = {}
        for kind in KINDS:
            ms = np.array([1000 * p["phases"][column]["by_kind"][kind]["predicted_s"] for p in report["pipelines"]])
            bars[kind] = ax.bar(names, ms, bottom=bottom, label=kind)
            bottom += ms
        drawn[label] = {
            name: {kind: float(bars[kind][i].get_height()) / 1000 for kind in KINDS} for i, name in enumerate(names)
        }
        ax.set(title=label, ylabel="predicted ms")
        ax.tick_params(axis="x", labelrotation=30)
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return drawn
