"""Issue 34 benchmark: analyse real-derived large snapshots (make_real_snapshot.py: a real recording of
../shared/real repeated to N entries), side by side with a bare pickle.load of the same file, in one run.

    python benchmarks/bench_real.py [--entries 1000000] [--repeats 3] [--cases cpp-frames,expandable,python-frames]

For each case: `pickle.load`, `analyze FILE --format json` (every remedy's replay included) and
`analyze FILE --format html`, interleaved (measure.compare: medians, each child's own peak RSS). The synthetic
snapshot of make_large_snapshot.py (no allocator settings, no annotations) is measured too, as the lower bound.
Goals: JSON within 2x pickle.load's time and 1.3x its peak RSS, HTML within 2.5x.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from make_real_snapshot import CASES, REAL
from measure import compare, print_table

DATA = Path(__file__).resolve().parent / "data"
HERE = Path(__file__).resolve().parent


def build(case: str, entries: int) -> Path:
    """The case's input (made once, in a child process so that this one stays small: its size would not count,
    but its memory would crowd the children's)."""
    path = DATA / (f"real_{case}_{entries}.pickle" if case != "synthetic" else f"snapshot_{entries}.pickle")
    if not path.exists():
        maker = [str(HERE / "make_large_snapshot.py"), str(path)] if case == "synthetic" else \
            [str(HERE / "make_real_snapshot.py"), case, str(path)]
        subprocess.run([sys.executable, *maker, "--entries", str(entries)], check=True)
    return path


def commands(path: Path) -> dict[str, list[str]]:
    python = sys.executable
    return {
        "pickle.load (baseline)": [python, "-c", f"import pickle; pickle.load(open({str(path)!r}, 'rb'))"],
        "analyze FILE --format json": [python, "-m", "analyzer", str(path), "--format", "json", "-q",
                                       "-o", str(DATA / "out.json")],
        "analyze FILE --format html": [python, "-m", "analyzer", str(path), "--format", "html", "-q",
                                       "-o", str(DATA / "out.html")],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--entries", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cases", default=",".join([*(c for c in CASES if c != "small"), "synthetic"]))
    args = parser.parse_args()
    cases = args.cases.split(",")
    if not REAL.is_dir():
        print(f"{REAL} is absent: only the synthetic case can be measured")
        cases = [c for c in cases if c == "synthetic"]
    for case in cases:
        path = build(case, args.entries)
        source = CASES[case][0] if case in CASES else "make_large_snapshot.py"
        print(f"\n{case}: {path.name}, {path.stat().st_size / 2**20:.0f} MiB, from {source}")
        print_table(compare(commands(path), args.repeats), "pickle.load (baseline)")


if __name__ == "__main__":
    main()
