"""Issue 16 benchmark: attribution on the zoo (fixtures/traces/zoo: transformers, PEFT, custom optimizers,
compile, accumulation, autocast), scored against truth from identity, without analyzer's capture tags.

Per case and per recording style (Python frames only, and `stacks="all"` with C++ and CPython frames):
share of the peak's bytes in the right category, share of all allocated bytes over the recording in the right
category (each allocation counted once by its block size), share of the peak's bytes labelled with the right
module class (`analyzer.evaluate.accuracy.zoo_scores`). The bars: 95% / 90% / 85% in every case.

    python benchmarks/zoo_accuracy.py [--out benchmarks/results/zoo_accuracy.md]
"""
from __future__ import annotations

import argparse
from pathlib import Path

from analyzer.evaluate.accuracy import simulator_sources, zoo_scores

ROOT = Path(__file__).resolve().parents[1]
ZOO = ROOT / "fixtures" / "traces" / "zoo"
RESULTS = Path(__file__).resolve().parent / "results" / "zoo_accuracy.md"
BARS = {"category_peak": 0.95, "category_recording": 0.90, "module_class_peak": 0.85}
HEADERS = {"category_peak": "category at peak", "category_recording": "category over recording",
           "module_class_peak": "module class at peak"}


def fixtures() -> list[tuple[str, str, Path]]:
    """(case, stacks, path) of every zoo fixture."""
    found = []
    for path in sorted(ZOO.glob("*.pickle")):
        case, _, style = path.stem.partition(".")
        found.append((case, style or "python", path))
    return found


def table() -> tuple[str, int]:
    """The markdown table and the number of (case, measure) pairs under their bar."""
    header = ["case", "stacks", *HEADERS.values(), "all bars met"]
    rows, misses = [], 0
    for case, stacks, path in fixtures():
        scores = zoo_scores(path, tags=False, source_roots=simulator_sources())
        met = [scores[k] >= bar for k, bar in BARS.items()]
        misses += met.count(False)
        rows.append([case, stacks, *(f"{scores[k]:.1%}" + ("" if ok else " ✗") for k, ok in zip(BARS, met, strict=True)),
                     "yes" if all(met) else "no"])
    lines = [header, ["---", "---"] + ["---:"] * (len(header) - 2), *rows]
    return "\n".join("| " + " | ".join(cells) + " |" for cells in lines), misses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    body, misses = table()
    bars = ", ".join(f"{HEADERS[k]} ≥ {v:.0%}" for k, v in BARS.items())
    text = "\n\n".join(["# Zoo accuracy (benchmarks/zoo_accuracy.py)",
                        f"Without capture tags; truth from identity (simulate/zoo.py). Bars: {bars}; ✗ marks a miss.",
                        body, f"{misses} measure(s) under their bar."]) + "\n"
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)


if __name__ == "__main__":
    main()
