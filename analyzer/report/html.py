"""The self-contained HTML report: one file with its CSS, SVG charts, its data and one script inlined (uPlot,
vendored in analyzer/report/vendor, and the explorer); it loads nothing.

The page's Content-Security-Policy forbids every fetch and allows only that script (by its hash), so the report
behaves the same opened from disk, from a mail attachment or from an issue, and a string from the input file
can never become markup (autoescaping; the embedded JSON escapes `<`, `>` and `&`, and the script writes text
with textContent) nor run (CSP). The PDF is rendered from this same HTML: WeasyPrint runs no script, so it shows
the static charts and tables the page hides on screen once its script runs.
"""
from __future__ import annotations

import base64
import hashlib
from pathlib import Path
from typing import Any

from analyzer.report import interactive
from analyzer.report.interactive import allocator_pictures, embed_json, module_icicle, page_data
from analyzer.report.job_report import JobReport, Report
from analyzer.report.page import REPORT_CSS, TEMPLATES
from analyzer.report.plots import figure_svg, memory_figure
from analyzer.report.view import ReportView, build_view

_HERE = Path(__file__).parent
_CHART_CSS = (_HERE / "vendor" / "uPlot.min.css").read_text(encoding="utf-8")
# print.js opens every <details> while printing; uPlot draws the charts; report.js is the explorer
_SCRIPT = "\n".join([(_HERE / "templates" / "print.js").read_text(encoding="utf-8"),
                     (_HERE / "vendor" / "uPlot.iife.min.js").read_text(encoding="utf-8"),
                     (_HERE / "templates" / "report.js").read_text(encoding="utf-8")])
_SCRIPT_HASH = "sha256-" + base64.b64encode(hashlib.sha256(_SCRIPT.encode()).digest()).decode()
PRINT_LIVE = 10  # allocations with stacks on paper (the page's print style hides the rest)
_COLORS = {"used": interactive.USED_COLORS, "waste": interactive.WASTE_COLOR, "free": interactive.FREE_COLOR,
           "largest": interactive.LARGEST_FREE_COLOR}


def render_html(report: Report) -> str:
    """The page of one recording (with the explorer) or of a job (its ranks' devices, without the explorer:
    the allocations stayed on the workers; `analyze RANK_FILE` explores one rank)."""
    if isinstance(report, JobReport):
        pictures = report.pictures
        return _render(report.view, {"devices": []}, {}, {k: p.allocator for k, p in pictures.items()},
                       {k: p.icicle for k, p in pictures.items()})
    data = page_data(report)
    explore = {x["device"]: {"index": i, "exact": x["exact"], "allocations": x["allocations"]}
               for i, x in enumerate(data["devices"])}
    return _render(build_view(report), data, explore, {d.device: allocator_pictures(d) for d in report.devices},
                   {d.device: module_icicle(d) for d in report.devices})


def _render(view: ReportView, data: dict[str, Any], explore: dict[int, dict[str, Any]],
            allocator: dict[int, Any], icicles: dict[int, Any]) -> str:
    charts = {d.device: figure_svg(memory_figure([d.chart]), f"chart{i}")
              for i, d in enumerate(view.devices) if d.chart is not None}
    return TEMPLATES.get_template("report.html.j2").render(
        v=view, devices=view.devices, charts=charts, css=REPORT_CSS, chart_css=_CHART_CSS, script=_SCRIPT,
        script_hash=_SCRIPT_HASH, print_live=PRINT_LIVE, data=embed_json(data), explore=explore,
        allocator=allocator, icicles=icicles, colors=_COLORS,
    )


def write_html(report: Report, out: Path) -> list[Path]:
    out.write_text(render_html(report), encoding="utf-8")
    return [out]
