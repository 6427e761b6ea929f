"""Charts as inline SVG (vector, no external files, no scripts), drawn with matplotlib's Agg-free SVG backend."""
from __future__ import annotations

import io

import matplotlib

matplotlib.use("svg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from analyzer.timeline import downsample  # noqa: E402

GIB = 2**30


def memory_over_time_svg(timeline: pd.DataFrame, peak_seq: int, oom_seq: int | None, title: str) -> str:
    """Allocated, requested and reserved GiB over the events of one device, with the peak and OOM marked."""
    points = downsample(timeline)
    x = points["seq"].to_numpy()
    fig, ax = plt.subplots(figsize=(9, 3.2), dpi=100)
    ax.fill_between(x, points["allocated_bytes"] / GIB, step="post", alpha=0.35, color="#3b7dd8", label="allocated")
    ax.step(x, points["requested_bytes"] / GIB, where="post", color="#1d4f91", linewidth=0.8, label="requested")
    ax.step(x, points["reserved_bytes"] / GIB, where="post", color="#d8733b", linewidth=1.2, label="reserved")
    peak = timeline[timeline["seq"] == peak_seq]
    if len(peak):
        ax.axvline(peak_seq, color="#b00020", linestyle="--", linewidth=0.8)
        ax.annotate("peak", (peak_seq, float(peak["allocated_bytes"].iloc[0]) / GIB), color="#b00020", fontsize=8,
                    xytext=(4, 4), textcoords="offset points")
    if oom_seq is not None:
        ax.axvline(oom_seq, color="black", linewidth=1.2)
        ax.annotate("OOM", (oom_seq, ax.get_ylim()[1] * 0.9), fontsize=8, xytext=(4, 0), textcoords="offset points")
    ax.set_xlabel("allocator event")
    ax.set_ylabel("GiB")
    ax.set_title(title, fontsize=10)
    ax.legend(loc="upper left", fontsize=8, frameon=False)
    ax.grid(alpha=0.25)
    fig.tight_layout()
    buffer = io.StringIO()
    fig.savefig(buffer, format="svg", metadata={"Creator": None, "Date": None, "Format": None, "Type": None})
    plt.close(fig)
    svg = buffer.getvalue()
    return svg[svg.index("<svg"):]  # drop the XML prolog and DOCTYPE: the SVG is inlined into HTML
