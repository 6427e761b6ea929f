"""What the CLI does with a file, in-process: read it, analyse every trace, print the summary, make the JSON.

A hostile input may end in an AnalyzerError (which must name the file) or in complete analyses, whose own
consistency `check_analysis` verifies; anything else escaping from here is a bug.
"""
from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pandas as pd
from rich.console import Console

from analyzer.core.trace import MemoryTrace, MultiRankTrace
from analyzer.errors import AnalyzerError
from analyzer.ingest import load
from analyzer.pipeline import analyze
from analyzer.report.text import print_summary
from analyzer.result import Analysis


def analyse_file(path: Path) -> list[Analysis]:
    """Analyses of every trace in `path` (one, or one per rank), summaries printed and JSON made; an
    AnalyzerError propagates after checking that it names the file."""
    try:
        loaded = load(path)
    except AnalyzerError as error:
        assert error.path is not None and Path(error.path).name.startswith(path.name), (error.path, path)
        raise
    traces = loaded.traces if isinstance(loaded, MultiRankTrace) else [loaded]
    analyses = [analyze(trace) for trace in traces]
    for analysis in analyses:
        print_summary(analysis, Console(file=io.StringIO(), width=120))
        json.loads(analysis.to_json_text(), parse_constant=_not_json)
    return analyses


def outcome(path: Path) -> AnalyzerError | list[Analysis]:
    """The AnalyzerError the file ends in, or its analyses (each checked)."""
    try:
        analyses = analyse_file(path)
    except AnalyzerError as error:
        return error
    for analysis in analyses:
        check_analysis(analysis)
    return analyses


def _not_json(constant: str) -> None:
    raise AssertionError(f"the JSON report holds {constant}, which JSON does not have")


def live_sums(trace: MemoryTrace, device: int, column: str) -> np.ndarray:
    """`column` summed over the allocations live after each event of `device` (and before the first), computed
    here from the allocations table alone, not by the analyzer's replay."""
    a = trace.allocations[trace.allocations["device"] == device]
    n = int((trace.events["device"] == device).sum())
    born = a["seq_alloc"].to_numpy(dtype=np.float64, na_value=-np.inf)
    dies = a["seq_free"].to_numpy(dtype=np.float64, na_value=np.inf)
    seqs = np.arange(-1, n)[:, None]
    alive = (born[None, :] <= seqs) & (dies[None, :] > seqs)
    return (alive * a[column].to_numpy(dtype=np.int64)[None, :]).sum(axis=1)


def check_analysis(analysis: Analysis) -> None:
    """What holds for every complete analysis, whatever the input: totals are the sums of the live allocations,
    every breakdown sums to the peak it breaks down, and the peak is the timeline's maximum."""
    trace = analysis.trace
    timeline = trace.timeline
    for d in analysis.devices:
        rows = timeline[timeline["device"] == d.device]
        for column in ("allocated_bytes", "requested_bytes"):
            assert (rows[column].to_numpy() == live_sums(trace, d.device, column)).all(), column
        assert d.peak.allocated_bytes == int(rows["allocated_bytes"].max())
        assert int(d.peak.live["allocated_bytes"].sum()) == d.peak.allocated_bytes
        for split in (d.by_category, d.by_phase, d.by_module):
            assert sum(r["bytes"] for r in split) == d.peak.allocated_bytes, split
        assert (rows["allocated_bytes"] >= 0).all() and (rows["requested_bytes"] >= 0).all()
        assert not pd.isna(d.peak.allocated_bytes)
