"""Memory over time as a matplotlib figure: inline SVG for HTML and PDF (vector, no files, no script), PNG for
Markdown. One drawing function, so the chart pasted into an issue is the chart in the report.

Figures are made with `matplotlib.figure.Figure`, not pyplot: no global state, no GUI backend, nothing to close.
"""
from __future__ import annotations

import io
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import matplotlib
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from analyzer.core.units import binary_unit
from analyzer.report.page import words
from analyzer.report.view import Chart

if TYPE_CHECKING:
    from matplotlib.typing import RcKeyType  # matplotlib >= 3.9; only the type checker reads it

_STYLE: dict[RcKeyType, Any] = {
    "text.parse_math": False,      # a `$` in a phase name is text, not TeX
    "svg.hashsalt": "analyzer",    # the same input draws the same SVG
    "font.size": 8,
    "axes.spines.top": False,
    "axes.spines.right": False,
}
RESERVED_COLOR = "#1b1f24"
PEAK_COLOR = "#b00020"
_LABEL_BOX = {"boxstyle": "square,pad=0.15", "facecolor": "white", "edgecolor": "none", "alpha": 0.8}
LABELLED_BAND = 0.06   # bands wider than this share of the x range carry their phase name


def _draw(ax: Axes, chart: Chart) -> None:
    points = chart.points
    reserved = points["reserved_bytes"] if "reserved_bytes" in points else None   # absent where not recorded
    top = max(float(points["allocated_bytes"].max()), 1.0, *([] if reserved is None else [float(reserved.max())]))
    scale, unit = binary_unit(top)
    x = points["seq"].to_numpy()
    x_end = float(x[-1]) + 1
    for band in chart.bands:
        ax.axvspan(band.start, band.end, color=band.color, alpha=0.10, linewidth=0)
        if (band.end - band.start) / max(x_end - x[0], 1) > LABELLED_BAND:
            ax.text((band.start + band.end) / 2, 1.0, band.phase, transform=ax.get_xaxis_transform(),
                    ha="center", va="bottom", fontsize=7, color="#5b6470", clip_on=False)
    lower = 0.0
    for name, column, color in chart.categories:
        upper = lower + points[column].to_numpy() / scale
        ax.fill_between(x, lower, upper, step="post", color=color, linewidth=0, alpha=0.85, label=words(name))
        lower = upper
    if reserved is not None:
        ax.step(x, reserved / scale, where="post", color=RESERVED_COLOR, linewidth=1.0, label="reserved")
    ax.axvline(chart.peak_seq, color=PEAK_COLOR, linestyle="--", linewidth=0.8)
    ax.annotate(f"peak {chart.peak_bytes / scale:.2f} {unit}", (chart.peak_seq, chart.peak_bytes / scale),
                color=PEAK_COLOR, xytext=(-4, 6), textcoords="offset points", ha="right", fontsize=8, bbox=_LABEL_BOX)
    if chart.oom_seq is not None:
        ax.axvline(chart.oom_seq, color="black", linewidth=1.4)
        near_end = (chart.oom_seq - x[0]) / max(x_end - x[0], 1) > 0.85
        ax.annotate("OOM", (chart.oom_seq, 0.5), xycoords=("data", "axes fraction"), xytext=(-4 if near_end else 4, 0),
                    textcoords="offset points", ha="right" if near_end else "left", fontsize=8, fontweight="bold",
                    bbox=_LABEL_BOX)
    ceiling = top
    if chart.capacity_bytes and chart.capacity_bytes <= 1.5 * top:  # a far-away capacity would flatten the curve
        ax.axhline(chart.capacity_bytes / scale, color="#5b6470", linestyle=":", linewidth=1.0, label="device capacity")
        ceiling = max(top, chart.capacity_bytes)
    ax.set_xlim(x[0], x_end)
    ax.set_ylim(0, ceiling / scale * 1.08)
    ax.set_xlabel("allocator event")
    ax.set_ylabel(unit)
    ax.set_title(chart.title, fontsize=9, loc="left", pad=12)
    ax.grid(axis="y", alpha=0.25)
    handles, labels = ax.get_legend_handles_labels()
    stacked = len(chart.categories)
    handles[:stacked], labels[:stacked] = handles[:stacked][::-1], labels[:stacked][::-1]  # legend reads as the stack
    phases = {b.phase: b.color for b in chart.bands}
    handles += [Patch(color=c, alpha=0.25) for c in phases.values()]
    labels += [f"phase: {p}" for p in phases]
    ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, frameon=False)


def memory_figure(charts: list[Chart]) -> Figure:
    """Allocated bytes stacked by category, reserved bytes, phase bands, the peak and the OOM: one row per chart."""
    with matplotlib.rc_context(_STYLE):
        fig = Figure(figsize=(10, 3.2 * len(charts)), dpi=100, layout="constrained")
        for ax, chart in zip(fig.subplots(len(charts), 1, squeeze=False)[:, 0], charts, strict=True):
            _draw(ax, chart)
    return fig


def figure_svg(fig: Figure, id_prefix: str) -> str:
    """The figure as an `<svg>` element to inline in HTML: no prolog, no comments (matplotlib copies text into
    them), and element ids prefixed so that several charts in one page do not share ids."""
    buffer = io.StringIO()
    with matplotlib.rc_context(_STYLE):
        fig.savefig(buffer, format="svg", metadata={"Creator": None, "Date": None, "Format": None, "Type": None})
    svg = buffer.getvalue()
    svg = re.sub(r"<!--.*?-->", "", svg[svg.index("<svg"):], flags=re.S)
    # a tenth of a pixel is precise enough for path coordinates, and halves the size (not for transforms)
    svg = re.sub(r'\bd="[^"]*"', lambda m: re.sub(r"(\.\d)\d+", r"\1", m.group(0)), svg)
    svg = re.sub(r"\n\s+", "\n", svg)
    svg = re.sub(r'\bid="([^"]+)"', rf'id="{id_prefix}-\1"', svg)
    return re.sub(r'(href="#|url\(#)([^")]+)', rf"\1{id_prefix}-\2", svg)


def save_png(fig: Figure, path: Path) -> None:
    with matplotlib.rc_context(_STYLE):
        fig.savefig(path, format="png", dpi=100)
