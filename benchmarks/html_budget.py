"""The HTML report's budgets (issue 19): the report of a 1M-entry snapshot stays under 5 MB and becomes
interactive in under 2 s in headless Chromium; and the chart's category colours stay apart for a reader with
deuteranopia. Measured, not asserted: `python benchmarks/html_budget.py [--entries N] [--repeats K] [--case C]`
(C: synthetic, make_large_snapshot.py's snapshot, the default; or a real-derived case of make_real_snapshot.py,
built into benchmarks/data/ as bench_real.py builds it).

Time to interactive is what the page itself records when its script has drawn every chart and listed the live
set at the peak (`document.documentElement.dataset.interactiveMs`, `performance.now()` since navigation start),
read over the DevTools protocol (tests/support/chromium.py); the median of K fresh loads is printed.
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "tests")]

from bench_real import build  # noqa: E402
from make_large_snapshot import make  # noqa: E402
from make_real_snapshot import CASES  # noqa: E402

import analyzer  # noqa: E402
from analyzer.core.vocabulary import Category, category_color  # noqa: E402
from analyzer.report.html import write_html  # noqa: E402
from support.chromium import Chromium, chromium_binary  # noqa: E402

MAX_BYTES = 5 * 2**20
MAX_INTERACTIVE_S = 2.0
# Machado, Oliveira & Fernandes (2009), deuteranopia at severity 1.0, on linear RGB
DEUTERANOPIA = np.array([[0.367322, 0.860646, -0.227968], [0.280085, 0.672501, 0.047413],
                         [-0.011820, 0.042940, 0.968881]])


def _lab(rgb: np.ndarray) -> np.ndarray:
    """CIELAB (D65) of linear RGB rows."""
    xyz = rgb @ np.array([[0.4124, 0.3576, 0.1805], [0.2126, 0.7152, 0.0722], [0.0193, 0.1192, 0.9505]]).T
    xyz /= np.array([0.95047, 1.0, 1.08883])
    f = np.where(xyz > (6 / 29) ** 3, np.cbrt(xyz), xyz / (3 * (6 / 29) ** 2) + 4 / 29)
    return np.stack([116 * f[:, 1] - 16, 500 * (f[:, 0] - f[:, 1]), 200 * (f[:, 1] - f[:, 2])], axis=1)


def colour_distances() -> tuple[float, float, str]:
    """(smallest ΔE76 between two category colours, the same under simulated deuteranopia, that pair)."""
    names = [str(c) for c in Category]
    srgb = np.array([[int(category_color(n)[i:i + 2], 16) / 255 for i in (1, 3, 5)] for n in names])
    linear = np.where(srgb <= 0.04045, srgb / 12.92, ((srgb + 0.055) / 1.055) ** 2.4)
    seen, simulated = _lab(linear), _lab(np.clip(linear @ DEUTERANOPIA.T, 0, 1))
    pairs = list(itertools.combinations(range(len(names)), 2))
    normal = min(float(np.linalg.norm(seen[i] - seen[j])) for i, j in pairs)
    i, j = min(pairs, key=lambda p: float(np.linalg.norm(simulated[p[0]] - simulated[p[1]])))
    return normal, float(np.linalg.norm(simulated[i] - simulated[j])), f"{names[i]} / {names[j]}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--entries", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--case", default="synthetic", choices=["synthetic", *CASES])
    args = parser.parse_args()
    # tests/support/chromium.py hands the browser fds 3 and 4: they must exist and its pipes must lie above them
    keep = [os.open(os.devnull, os.O_RDONLY) for _ in range(4)]  # noqa: F841 - held open until the end
    binary = chromium_binary()
    if binary is None:
        sys.exit("chromium is not installed (apt-get install chromium)")
    with tempfile.TemporaryDirectory() as folder:
        snapshot, page = Path(folder) / "large.pickle", Path(folder) / "large.html"
        if args.case == "synthetic":
            import pickle

            snapshot.write_bytes(pickle.dumps(make(args.entries), protocol=4))
        else:
            snapshot = build(args.case, args.entries)
        start = time.perf_counter()
        analysis = analyzer.analyze(snapshot)
        analysed = time.perf_counter() - start
        start = time.perf_counter()
        write_html(analysis, page)
        rendered = time.perf_counter() - start
        size = page.stat().st_size
        times, errors, exact = [], [], None
        for _ in range(args.repeats):
            with Chromium(binary, timeout_s=120) as browser:
                record = browser.open(page.as_uri())
                errors += record.errors() + [u for u in record.requests if u != page.as_uri()]
                times.append(float(browser.evaluate("document.documentElement.dataset.interactiveMs")) / 1000)
                exact = browser.evaluate("document.querySelector('section.explore').dataset.liveBytes")
    d = analysis.devices[0]
    normal, deuteranopia, pair = colour_distances()
    print(f"snapshot ({args.case}): {args.entries:,} entries, {len(analysis.trace.allocations):,} allocations; "
          f"analysis {analysed:.1f} s, HTML written in {rendered:.1f} s")
    print(f"HTML size: {size / 2**20:.2f} MiB (budget {MAX_BYTES / 2**20:.0f} MiB) "
          f"{'OK' if size < MAX_BYTES else 'OVER'}")
    print(f"time to interactive: median {median(times):.2f} s of {args.repeats} loads "
          f"(min {min(times):.2f}, max {max(times):.2f}; budget {MAX_INTERACTIVE_S:.0f} s) "
          f"{'OK' if median(times) < MAX_INTERACTIVE_S else 'OVER'}")
    print(f"live set at the peak in the page: {exact} bytes; the analysis: {d.peak.allocated_bytes} bytes")
    print(f"console errors or requests: {errors or 'none'}")
    print(f"category colours: smallest ΔE76 {normal:.1f}; with deuteranopia (Machado 2009) {deuteranopia:.1f} "
          f"({pair})")


if __name__ == "__main__":
    main()
