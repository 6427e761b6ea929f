"""Issue 2 benchmark: analyse a large snapshot, side by side with bare pickle.load and torch's own
`python -m torch.cuda._memory_viz stats` on the same file, in one run.

    python benchmarks/bench_snapshot.py [--entries 1000000] [--repeats 3]

Targets: the whole `analyze FILE --format json` within 2x the wall time of bare pickle.load and within
1.5x its peak RSS.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from measure import compare, print_table

DATA = Path(__file__).resolve().parent / "data"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--entries", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    path = DATA / f"snapshot_{args.entries}.pickle"
    if not path.exists():  # in a child process: a large parent would inflate the children's peak RSS
        subprocess.run([sys.executable, str(Path(__file__).with_name("make_large_snapshot.py")), str(path),
                        "--entries", str(args.entries)], check=True)
    print(f"{path.name}: {path.stat().st_size / 2**20:.0f} MiB, {args.entries} trace entries")
    python = sys.executable
    results = compare({
        "pickle.load (baseline)": [python, "-c", f"import pickle; pickle.load(open({str(path)!r}, 'rb'))"],
        "analyze FILE --format json": [python, "-m", "analyzer", str(path), "--format", "json", "-o",
                                       str(DATA / "out.json"), "-q"],
        "torch.cuda._memory_viz stats": [python, "-m", "torch.cuda._memory_viz", "stats", str(path)],
    }, args.repeats)
    print_table(results, "pickle.load (baseline)")


if __name__ == "__main__":
    main()
