"""Parameters, gradients and optimizer state at the peak of every real recording, against what the recording's
own source code says (../shared/real/truth.json): the accuracy that every later number stands on.

    python benchmarks/real_truth.py [--out benchmarks/results/real_truth.md]
"""
from __future__ import annotations

import argparse
from pathlib import Path

from analyzer.core.units import human_bytes
from analyzer.evaluate.real_truth import Check, checks, load_truth

ROOT = Path(__file__).resolve().parents[1]
REAL = ROOT.parent / "shared" / "real"
RESULTS = Path(__file__).resolve().parent / "results" / "real_truth.md"


def verdict(c: Check) -> str:
    if not c.held:
        return "not held"
    return "yes" if c.agrees else "**no**"


def table(rows: list[Check]) -> str:
    lines = ["| recording | device | category | truth | measured | agrees |", "|---|---|---|---:|---:|:---:|"]
    lines += [f"| {c.recording} | {c.device} | {c.category} | {human_bytes(c.truth_bytes)} | "
              f"{human_bytes(c.measured_bytes)} | {verdict(c)} |" for c in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    rows = [c for name, truth in load_truth(REAL).items() for c in checks(REAL, name, truth)]
    agreeing = sum(c.agrees for c in rows)
    held = [c for c in rows if c.held]
    text = (f"# Model states at the peak against the recordings' source code (benchmarks/real_truth.py)\n\n"
            f"**{agreeing} of {len(held)} checks agree where the recording holds the state** (within 10% of the "
            f"truth; where the truth is zero, at most 1% of the peak); {len(rows) - len(held)} more ask for bytes "
            f"made before a recording that does not say what was alive when it began (`not held`).\n\n"
            f"{table(rows)}\n")
    args.out.write_text(text, encoding="utf-8")
    print(text)


if __name__ == "__main__":
    main()
