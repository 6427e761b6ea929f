"""--export-trace: the original profiler trace plus memory counter tracks, on the trace's own clock."""
from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import analyzer
from analyzer.ingest.chrome_copy import copy_of
from analyzer.report.trace_export import COUNTER_PID, export_trace
from support.paths import FIXTURES


def _load_json(path: Path) -> dict:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)


def test_real_trace_keeps_every_event_and_gains_counters(real_dir: Path, tmp_path: Path) -> None:
    source = real_dir / "tracelens" / "gaunernst_bert-small-uncased__1016001.json.gz"
    analysis = analyzer.analyze(source)
    out = tmp_path / "with_memory.json.gz"
    export_trace(analysis, copy_of(analysis.trace), out)
    original, exported = _load_json(source), _load_json(out)
    counters = [e for e in exported["traceEvents"] if e.get("pid") == COUNTER_PID]
    assert len(exported["traceEvents"]) == len(original["traceEvents"]) + len(counters)
    assert {k for k in original if k != "traceEvents"} == {k for k in exported if k != "traceEvents"}
    # the counters by category sum, at their highest point, to the analysis' peak
    gpu = next(d for d in analysis.devices if d.device >= 0)
    by_category = [e for e in counters if e.get("ph") == "C" and e["name"] == f"cuda:{gpu.device} allocated by category"]
    assert max(sum(e["args"].values()) for e in by_category) == gpu.peak.allocated_bytes
    # and they sit on the trace's own clock: every counter time is the floor of a [memory] event time
    memory_times = {int(e["ts"]) for e in original["traceEvents"] if e.get("name") == "[memory]"}
    assert {int(e["ts"]) for e in by_category} <= memory_times


def test_export_needs_a_profiler_trace(tmp_path: Path) -> None:
    run = subprocess.run([sys.executable, "-m", "analyzer", str(FIXTURES / "sim" / "capacity_oom.pickle"),
                          "--export-trace", str(tmp_path / "x.json"), "-q"], capture_output=True, text=True)
    assert run.returncode == 2 and "Kineto" in run.stderr
    assert not (tmp_path / "x.json").exists()
