"""Issue 5 benchmark: how much of the peak does attribution label, and how often is the label right?

- simulated snapshots (fixtures/traces/sim): share of peak bytes whose category, phase and module match the
  ground truth (`analyzer.evaluate.accuracy.peak_agreement`), with analyzer's capture tags and without them
  (the same file as a plain `_record_memory_history` recording would have it);
- real snapshots (../shared/real): no truth, so the share of peak bytes that gets a phase, a category and a
  module other than `unattributed`, with what the file gave to work with (history, stacks, annotations);
- modules without tags are call paths of class names (`GPT › Block[3] › MLP`), not FQNs: the simulated
  fixtures are also scored by module class (needs torch), and the real snapshots with Python frames get the
  unattributed-module share of their peak (all devices' peaks together), its median, the share labelled by a
  whole model and no module in it, and the share of the peak whose module's innermost level has its class read
  (not a `file:line forward` frame).

    python benchmarks/attribution_accuracy.py [--out benchmarks/results/attribution_accuracy.md]
"""
from __future__ import annotations

import argparse
import re
import statistics
from collections.abc import Iterable
from pathlib import Path

import pandas as pd

import analyzer
from analyzer.attribute import attribute
from analyzer.core.timeline import find_peak
from analyzer.core.trace import MemoryTrace
from analyzer.core.vocabulary import MODULE_PATH_SEPARATOR, NO_MODULE, UNATTRIBUTED, names_module
from analyzer.evaluate.accuracy import peak_agreement, simulator_sources
from analyzer.evaluate.module_classes import (
    has_python_frames,
    module_class_agreement,
    module_share,
    simulator_classes,
    unattributed_module_share,
    whole_model_share,
)
from analyzer.pipeline import active_devices

ROOT = Path(__file__).resolve().parents[1]
SIM = ROOT / "fixtures" / "traces" / "sim"
REAL = ROOT.parent / "shared" / "real"
RESULTS = Path(__file__).resolve().parent / "results" / "attribution_accuracy.md"
FIELDS = ("category", "phase", "module")
_CLASS_LEVEL = re.compile(r"^[A-Za-z_]\w*(\[\d+\])?$")   # a call path level that is a class, not a frame


def markdown(header: list[str], rows: Iterable[list[str]]) -> str:
    """A markdown table; every column but the first is right-aligned (they hold numbers or yes/no)."""
    lines = [header, ["---"] + ["---:"] * (len(header) - 1), *rows]
    return "\n".join("| " + " | ".join(cells) + " |" for cells in lines)


def sim_table() -> str:
    try:
        classes = simulator_classes()
    except ImportError:   # no torch here: the simulator's model cannot be built
        classes = None
    sources = simulator_sources()
    rows = []
    for path in sorted(SIM.glob("*.pickle")):
        tagged = peak_agreement(path, tags=True, source_roots=sources)
        plain = peak_agreement(path, tags=False, source_roots=sources)
        by_class = f"{module_class_agreement(path, classes, source_roots=sources)['module_class']:.1%}" if classes else "-"
        rows.append([path.stem, *(f"{tagged[f]:.1%}" for f in FIELDS), *(f"{plain[f]:.1%}" for f in FIELDS), by_class])
    header = ["fixture", *(f"{f} (tags)" for f in FIELDS), *(f"{f} (no tags)" for f in FIELDS),
              "module class (no tags)"]
    return markdown(header, rows)


def _class_read_share(trace: MemoryTrace) -> float:
    """Of the bytes at the devices' peaks with a module, the share whose innermost level is a class."""
    named = read = 0
    for device in active_devices(trace):
        live = find_peak(trace, device).live
        modules = live["module"].astype(str)
        known = modules.map(names_module).astype(bool)
        named += int(live.loc[known, "allocated_bytes"].sum())
        classed = modules.map(lambda m: bool(_CLASS_LEVEL.match(m.split(MODULE_PATH_SEPARATOR)[-1]))).astype(bool)
        read += int(live.loc[known & classed, "allocated_bytes"].sum())
    return read / named if named else 0.0


def module_table() -> str:
    """Real snapshots with Python frames: the peak's unattributed-module share, and the median."""
    rows, shares, coarse = [], [], []
    for path in sorted(p for p in REAL.rglob("*") if p.suffix in (".pickle", ".pkl")):
        loaded = analyzer.load(path)
        if not isinstance(loaded, MemoryTrace) or not has_python_frames(loaded):
            continue
        trace = attribute(loaded)
        share = unattributed_module_share(trace)
        if share is None:
            continue
        whole = whole_model_share(trace) or 0.0
        shares.append(share)
        coarse.append(share + whole)
        rows.append([str(path.relative_to(REAL)), f"{share:.1%}", f"{module_share(trace, NO_MODULE) or 0.0:.1%}",
                     f"{whole:.1%}", f"{_class_read_share(trace):.1%}"])
    rows.append([f"**median of {len(shares)}**", f"**{statistics.median(shares):.1%}**" if shares else "-", "",
                 f"(with unattributed: **{statistics.median(coarse):.1%}**)" if coarse else "", ""])
    return markdown(["snapshot with Python frames", "module unattributed", "made outside every module",
                     "the whole model only", "class read (of those with a module)"], rows)


def attributed_share(live: pd.DataFrame, field: str) -> str:
    """Share of the peak's bytes whose `field` is known."""
    total = live["allocated_bytes"].sum()
    if not total:
        return "-"
    return f"{live.loc[live[field].astype(str) != UNATTRIBUTED, 'allocated_bytes'].sum() / total:.1%}"


def real_rows(path: Path) -> list[list[str]]:
    """One row per active device of a real snapshot (one row saying so when none holds memory)."""
    trace = attribute(analyzer.load(path))
    has_python = any(frame[0].endswith(".py") for frames in trace.stacks["frames"] for frame in frames)
    facts = ["yes" if trace.has_history else "no", "yes" if has_python else "no", str(len(trace.annotations))]
    name = str(path.relative_to(REAL))
    devices = active_devices(trace)
    if not devices:
        return [[name, "-", "0.00", "-", "-", "-", *facts]]
    rows = []
    for device in devices:
        live = find_peak(trace, device).live
        rows.append([name, str(device), f"{live['allocated_bytes'].sum() / 2**30:.2f}",
                     *(attributed_share(live, f) for f in ("phase", "category", "module")), *facts])
    return rows


def real_table() -> str:
    paths = sorted(p for p in REAL.rglob("*") if p.suffix in (".pickle", ".pkl"))
    header = ["snapshot", "device", "peak GiB", "phase known", "category known", "module known", "history",
              "Python frames", "annotations"]
    return markdown(header, (row for path in paths for row in real_rows(path)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    parts = ["# Attribution accuracy (benchmarks/attribution_accuracy.py)",
             "## Simulated snapshots: share of peak bytes whose label matches the ground truth", sim_table()]
    if REAL.is_dir():
        parts += ["## Real snapshots (../shared/real): share of peak bytes with a label other than `unattributed`",
                  real_table(),
                  "## Real snapshots with Python frames: share of the peak whose module is `unattributed`",
                  module_table()]
    else:
        parts.append(f"(real snapshots not found at {REAL})")
    text = "\n\n".join(parts) + "\n"
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)


if __name__ == "__main__":
    main()
