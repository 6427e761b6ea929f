"""Screenshots of the HTML report's explorer and allocator view for the docs (docs/guide/img/), made from real
recordings in ../shared/real (never copied into the repository): `python scripts/report_screenshots.py`.
Needs chromium; each picture is the browser's viewport at the section named, as a reader sees it."""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import analyzer  # noqa: E402
from analyzer.report.html import write_html  # noqa: E402
from support.chromium import Chromium, chromium_binary  # noqa: E402
from support.paths import REAL  # noqa: E402

OUT = ROOT / "docs" / "guide" / "img"
#: (recording, picture name, the section each picture starts at)
SHOTS = [
    ("constructor-sun-code_location/memory_snapshot.pickle", "real-3gpu-oom", ["#summary", "#explore-1", "#allocator-1"]),
    ("jaspersolt-eor_nn/snapshot.pickle", "real-snapshot", ["#explore-0"]),
    ("kineto-tb_plugin/resnet50_num_workers_0/worker0.1623143089861.pt.trace.json.gz", "real-profiler-trace",
     ["#explore-0"]),
]


def main() -> None:
    binary = chromium_binary()
    if binary is None or not REAL.is_dir():
        sys.exit("needs chromium and the real recordings in ../shared/real")
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(4)]  # noqa: F841 - the browser's fds 3 and 4
    OUT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as folder, Chromium(binary, timeout_s=120) as browser:
        for recording, name, sections in SHOTS:
            page = Path(folder) / f"{name}.html"
            write_html(analyzer.analyze(REAL / recording), page)
            record = browser.open(page.as_uri(), width=1200, height=860)
            if record.errors():
                sys.exit(f"{recording}: {record.errors()}")
            for k, section in enumerate(sections):
                browser.evaluate(f"document.querySelector({section!r}).scrollIntoView()")
                out = OUT / (f"{name}.png" if k == 0 else f"{name}-{k}.png")
                browser.screenshot(out, full_page=False)
                print(out.relative_to(ROOT), f"{out.stat().st_size / 1024:.0f} KiB")


if __name__ == "__main__":
    main()
