"""The self-contained HTML report: one file, CSS and SVG charts inlined, no script, no network."""
from __future__ import annotations

from pathlib import Path

import jinja2

from analyzer import __version__
from analyzer.analysis import Analysis
from analyzer.report.plots import memory_over_time_svg
from analyzer.report.units import human_bytes, relative_seconds

_ENV = jinja2.Environment(
    loader=jinja2.PackageLoader("analyzer.report", "templates"),
    autoescape=True,  # every string from an input file is escaped
    undefined=jinja2.StrictUndefined,
)
_ENV.filters["bytes"] = human_bytes


def render_html(analysis: Analysis) -> str:
    trace = analysis.trace
    origin = trace.time_origin_us
    devices = []
    for d in analysis.devices:
        timeline = trace.timeline[trace.timeline["device"] == d.device]
        devices.append({
            "d": d,
            "when": relative_seconds(d.peak.time_us, origin),
            "oom_when": relative_seconds(d.oom.time_us, origin) if d.oom else None,
            "chart": memory_over_time_svg(timeline, d.peak.event_index, d.oom.event_index if d.oom else None,
                                          f"cuda:{d.device}: memory over time"),
            "top": d.top_allocations(trace),
        })
    return _ENV.get_template("report.html.j2").render(
        analysis=analysis, trace=trace, devices=devices, version=__version__,
    )


def write_html(analysis: Analysis, out: Path) -> list[Path]:
    out.write_text(render_html(analysis), encoding="utf-8")
    return [out]
