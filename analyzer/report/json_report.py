"""`--format json`: the versioned analyzer/1 contract, to a file or to standard output."""
from __future__ import annotations

import sys
from pathlib import Path

from analyzer.result import Analysis


def write_json(analysis: Analysis, out: Path | None) -> list[Path]:
    text = analysis.to_json_text()
    if out is None:
        sys.stdout.write(text + "\n")
        return []
    out.write_text(text + "\n", encoding="utf-8")
    return [out]
