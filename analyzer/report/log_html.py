"""`--format html` for a log: one static page (no script, nothing loaded), every string autoescaped by the
reports' Jinja environment."""
from __future__ import annotations

from pathlib import Path

from analyzer.core.printable import visible
from analyzer.log_result import LogAnalysis
from analyzer.report.log_text import numbers_table
from analyzer.report.page import REPORT_CSS, TEMPLATES


def render_log_html(report: LogAnalysis) -> str:
    doc = report.to_json()
    for o in doc["ooms"]:
        o["message"] = visible(o["message"])
    return TEMPLATES.get_template("log.html.j2").render(doc=doc, verdict=visible(report.verdict), css=REPORT_CSS,
                                                        numbers=numbers_table)


def write_log_html(report: LogAnalysis, out: Path) -> list[Path]:
    out.write_text(render_log_html(report), encoding="utf-8")
    return [out]
