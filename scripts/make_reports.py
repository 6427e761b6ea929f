"""The example reports linked from the README: reports/<fixture>.html, .md (with its .png) and .pdf.

    python scripts/make_reports.py

Run from anywhere; the fixtures are read by paths relative to the repository, so the reports name them that way.
Needs the `pdf` extra (WeasyPrint) for the PDFs.
"""
from __future__ import annotations

import os
from pathlib import Path

from analyzer import analyze
from analyzer.report import SUFFIXES, reporter

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = {  # one per story the reports must tell
    "capacity_oom": "out of memory in the forward pass: the work does not fit",
    "fragmentation": "out of memory with memory free: fragmentation",
    "gpt_activation_peak": "no OOM; the peak is activations in backward",
    "checkpoint_gather": "the peak is the checkpoint being gathered on the GPU",
}
FORMATS = ("html", "md", "pdf")


def main() -> None:
    os.chdir(ROOT)
    out = Path("reports")
    out.mkdir(exist_ok=True)
    total = 0
    for name, story in FIXTURES.items():
        analysis = analyze(Path("fixtures/traces/sim") / f"{name}.pickle")
        for fmt in FORMATS:
            for path in reporter(fmt)(analysis, out / f"{name}{SUFFIXES[fmt]}"):
                size = path.stat().st_size
                total += size
                print(f"{path}  {size / 1024:.0f} KiB  ({story})")
    print(f"total {total / 2**20:.2f} MiB")


if __name__ == "__main__":
    main()
