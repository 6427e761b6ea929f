"""`--format pdf`: the HTML report laid out on A4 pages by WeasyPrint, charts kept as vectors.

The same template and view as the HTML (its print stylesheet paginates it), so the two never disagree.
WeasyPrint is the optional extra `pdf`; without it the user gets one line saying how to install it.
"""
from __future__ import annotations

import logging
from pathlib import Path

from analyzer.errors import AnalyzerError
from analyzer.report.html import render_html
from analyzer.report.job_report import Report


def write_pdf(report: Report, out: Path) -> list[Path]:
    try:
        import weasyprint
    except ImportError as error:
        raise AnalyzerError(None, f"PDF reports need WeasyPrint ({error})",
                            "Install it with: pip install 'oom-analyzer[pdf]'") from error
    # WeasyPrint warns about CSS it ignores (the dark colour scheme, the page script): not the user's concern
    logging.getLogger("weasyprint").setLevel(logging.ERROR)
    # no base URL and a fetcher that refuses everything: the report references nothing, and must not start to
    weasyprint.HTML(string=render_html(report), url_fetcher=_refuse).write_pdf(out)
    return [out]


def _refuse(url: str, *args: object, **kwargs: object) -> dict:
    raise ValueError(f"the report must load nothing, but asked for {url}")
