"""Reporters: each renders a finished Analysis and computes nothing of its own.

`REPORTERS` maps a `--format` name to "module:function(analysis, out_path) -> list[Path]" (the files written).
"""
from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path

REPORTERS: dict[str, str] = {
    "html": "analyzer.report.html:write_html",
    "json": "analyzer.report.json_report:write_json",
    "md": "analyzer.report.markdown:write_markdown",
    "pdf": "analyzer.report.pdf:write_pdf",
}

#: the reporters of a text log's analysis (analyzer.log_result.LogAnalysis), by the same format names
LOG_REPORTERS: dict[str, str] = {
    "html": "analyzer.report.log_html:write_log_html",
    "json": "analyzer.report.json_report:write_json",
    "md": "analyzer.report.log_markdown:write_log_markdown",
}

#: the file suffix each format writes when the user names no output
SUFFIXES: dict[str, str] = {"html": ".html", "json": ".json", "md": ".md", "pdf": ".pdf"}


def reporter(fmt: str, registry: dict[str, str] = REPORTERS) -> Callable[..., list[Path]]:
    module, function = registry[fmt].split(":")
    return getattr(importlib.import_module(module), function)
