"""`--format json`: the versioned analyzer/1 contract, to a file or to standard output."""
from __future__ import annotations

import sys
from pathlib import Path

from analyzer.report.job_report import Report


def write_json(report: Report, out: Path | None) -> list[Path]:
    text = report.to_json_text()
    if out is None:
        sys.stdout.write(text + "\n")
        return []
    out.write_text(text + "\n", encoding="utf-8")
    return [out]
