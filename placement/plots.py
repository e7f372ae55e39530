"""SLO-attainment plots in DistServe's style; matplotlib is imported only when a plot is drawn."""

from __future__ import annotations

import os
from pathlib import Path


def plot_attainment_vs_rate(
    series: dict[str, list[tuple[float, float]]],
    target: float | None,
    path: str | os.PathLike,
    title: str = "",
    marks: dict[str, float] | None = None,
) -> Path:
    """One line per deployment of (rate req/s, attainment fraction) points; the target dashed, and a
    dotted vertical line at each of ``marks`` (label: rate)."""
    # Attainment falls as the rate grows, so the lower left is free for the legend.
    return _plot(series, target, path, title, "Rate (req/s)", "lower left", marks)


def plot_attainment_vs_slo_scale(
    series: dict[str, list[tuple[float, float]]], target: float | None, path: str | os.PathLike, title: str = ""
) -> Path:
    """One line per deployment of (SLO scale, attainment fraction) points, the scale being applied
    to both the TTFT and TPOT SLOs (DistServe's Figures 8 and 9); the target dashed."""
    # Attainment rises as the SLOs loosen, so the lower right is free for the legend.
    return _plot(series, target, path, title, "SLO scale", "lower right")


def _plot(
    series: dict[str, list[tuple[float, float]]],
    target: float | None,
    path: str | os.PathLike,
    title: str,
    xlabel: str,
    legend_loc: str,
    marks: dict[str, float] | None = None,
) -> Path:
    # The object API with an Agg canvas leaves pyplot's global backend alone.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 4), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for name, points in series.items():
        xs, ys = zip(*sorted(points)) if points else ((), ())
        ax.plot(xs, [y * 100 for y in ys], marker="o", label=name)
    if target is not None:
        ax.axhline(target * 100, linestyle="--", color="gray", label=f"target {target:.0%}")
    for label, x in (marks or {}).items():
        ax.axvline(x, linestyle=":", color="black", label=label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("SLO attainment (%)")
    ax.set_ylim(0, 105)
    ax.grid(alpha=0.3)
    if title:
        ax.set_title(title, fontsize="small")
    ax.legend(loc=legend_loc, fontsize="small")  # inside the axes, never cut off at the figure's edge
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=120)
    return path
