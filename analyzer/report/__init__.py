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

#: the file suffix each format writes when the user names no output
SUFFIXES: dict[str, str] = {"html": ".html", "json": ".json", "md": ".md", "pdf": ".pdf"}


def reporter(fmt: str) -> Callable[..., list[Path]]:
    module, function = REPORTERS[fmt].split(":")
    return getattr(importlib.import_module(module), function)
