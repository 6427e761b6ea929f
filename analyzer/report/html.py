"""The self-contained HTML report: one file with its CSS, SVG charts and one tiny script inlined; it loads nothing.

The page's Content-Security-Policy forbids every fetch and allows only that script (by its hash), so the report
behaves the same opened from disk, from a mail attachment or from an issue, and a string from the input file
can never become markup (autoescaping) nor run (CSP). The PDF is rendered from this same HTML.
"""
from __future__ import annotations

import base64
import hashlib
from pathlib import Path

import jinja2

from analyzer.result import Analysis
from analyzer.report.plots import figure_svg, memory_figure
from analyzer.core.units import human_bytes
from analyzer.report.view import ReportView, build_view, words

_ENV = jinja2.Environment(
    loader=jinja2.PackageLoader("analyzer.report", "templates"),
    autoescape=True,  # every string from an input file is escaped
    undefined=jinja2.StrictUndefined,
)
_ENV.filters["bytes"] = human_bytes
_ENV.filters["pct"] = lambda share: f"{share:.1%}" if share < 0.1 else f"{share:.0%}"
_ENV.filters["label"] = words
_ENV.filters["onoff"] = lambda flag: {True: "on", False: "off"}.get(flag, "not recorded")

_TEMPLATES = Path(__file__).parent / "templates"
_CSS = (_TEMPLATES / "report.css").read_text(encoding="utf-8")
_SCRIPT = (_TEMPLATES / "print.js").read_text(encoding="utf-8")  # opens every <details> while printing
_SCRIPT_HASH = "sha256-" + base64.b64encode(hashlib.sha256(_SCRIPT.encode()).digest()).decode()
PRINT_LIVE = 10  # allocations with stacks on paper (the page's print style hides the rest)


def render_view(view: ReportView) -> str:
    charts = {d.device: figure_svg(memory_figure([d.chart]), f"chart{i}")
              for i, d in enumerate(view.devices) if d.chart is not None}
    return _ENV.get_template("report.html.j2").render(
        v=view, charts=charts, css=_CSS, script=_SCRIPT, script_hash=_SCRIPT_HASH, print_live=PRINT_LIVE,
    )


def render_html(analysis: Analysis) -> str:
    return render_view(build_view(analysis))


def write_html(analysis: Analysis, out: Path) -> list[Path]:
    out.write_text(render_html(analysis), encoding="utf-8")
    return [out]
