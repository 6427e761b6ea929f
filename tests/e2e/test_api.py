"""The pandas API and the JSON contract: documented columns, and the same numbers as the reports."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd

import analyzer
from analyzer.core.timeline import live_at
from analyzer.core.trace import TABLES
from support.paths import FIXTURES

SIM = FIXTURES / "sim"
CONTRACT_DEVICE_KEYS = {"device", "peak", "reserved_peak_bytes", "end", "trace_entries", "history_truncated", "oom",
                        "findings", "remedies"}
CONTRACT_PEAK_KEYS = {"allocated_bytes", "requested_bytes", "reserved_bytes", "time_us", "event_index",
                      "by_category", "by_phase", "by_module", "step", "phase"}


def test_tables_have_documented_columns() -> None:
    trace = analyzer.load(SIM / "gpt_activation_peak.pickle")
    for name, columns in TABLES.items():
        assert list(getattr(trace, name).columns) == list(columns), name
    assert {"device", "t_us", "seq", "allocated_bytes", "requested_bytes", "reserved_bytes"} <= set(trace.timeline.columns)


def test_notebook_groupby_matches_the_report() -> None:
    """Story 10: pandas on t.allocations gives the numbers the report shows."""
    result = analyzer.analyze(SIM / "gpt_activation_peak.pickle")
    d = result.devices[0]
    live = live_at(result.trace, 0, d.peak.event_index)
    by_category = live.groupby("category", observed=True)["allocated_bytes"].sum()
    assert {r["name"]: r["bytes"] for r in d.by_category} == {k: int(v) for k, v in by_category.items() if v}
    assert sum(r["bytes"] for r in d.by_category) == d.peak.allocated_bytes
    assert sum(r["bytes"] for r in d.by_phase) == d.peak.allocated_bytes
    assert sum(r["bytes"] for r in d.by_module) == d.peak.allocated_bytes
    categories = [c for c in result.trace.timeline.columns if c.endswith("_bytes") and c not in
                  ("allocated_bytes", "requested_bytes", "reserved_bytes")]
    timeline = result.trace.timeline
    assert (timeline[categories].sum(axis=1) == timeline["allocated_bytes"]).all()


def test_json_contract(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    run = subprocess.run([sys.executable, "-m", "analyzer", str(SIM / "capacity_oom.pickle"), "--format", "json",
                          "-o", str(out), "-q"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    doc = json.loads(out.read_text())
    assert doc["schema"] == "analyzer/1" and doc["source"]["kind"] == "snapshot"
    d = doc["devices"][0]
    assert CONTRACT_DEVICE_KEYS <= set(d)
    assert CONTRACT_PEAK_KEYS <= set(d["peak"])
    assert set(d["end"]) >= {"allocated_bytes", "reserved_bytes"}
    assert set(d["oom"]) >= {"requested_bytes", "device_free_bytes", "time_us", "event_index"}
    for finding in d["findings"]:
        assert {"kind", "severity", "bytes", "summary", "evidence"} <= set(finding)
    for remedy in d["remedies"]:
        assert {"id", "rank", "saved_bytes", "new_peak_bytes", "confidence", "try_first", "how"} <= set(remedy)
    assert sum(r["try_first"] for r in d["remedies"]) == 1


def test_analysis_of_a_loaded_trace_equals_analysis_of_the_path() -> None:
    path = SIM / "fragmentation.pickle"
    by_path = analyzer.analyze(path).to_json()
    by_trace = analyzer.analyze(analyzer.load(path)).to_json()
    assert by_path["devices"] == by_trace["devices"]


def test_every_allocation_is_labelled() -> None:
    trace = analyzer.analyze(SIM / "adam_first_step.pickle").trace
    a = trace.allocations
    for column in ("module", "phase", "category", "label_source"):
        assert a[column].notna().all()
    assert isinstance(a["step"].dtype, pd.Int64Dtype)
    assert a["label_source"].astype(str).str.startswith("phase=").all()


def test_analyze_a_set_of_ranks(tmp_path: Path) -> None:
    """`analyzer.analyze(dir)` on a folder of per-rank traces: one Analysis per rank, the same as each rank alone."""
    source = FIXTURES / "kineto" / "train.pt.trace.json.gz"
    for rank in (0, 1):
        (tmp_path / f"rank{rank}.pt.trace.json.gz").write_bytes(source.read_bytes())
    loaded = analyzer.load(tmp_path)
    assert isinstance(loaded, analyzer.MultiRankTrace) and len(loaded.traces) == 2
    for given in (tmp_path, str(tmp_path), loaded):
        result = analyzer.analyze(given)
        assert isinstance(result, analyzer.RankSetAnalysis)
        assert [a.trace.source_path for a in result.ranks] == [t.source_path for t in loaded.traces]
        alone = analyzer.analyze(source)
        assert [a.devices[0].peak.allocated_bytes for a in result.ranks] == [alone.devices[0].peak.allocated_bytes] * 2
        doc = result.to_json()
        assert doc["source"]["kind"] == "ranks" and len(doc["devices"]) == 2 * len(alone.devices)


def test_analyze_leaves_the_loaded_trace_as_it_was() -> None:
    trace = analyzer.load(SIM / "capacity_oom.pickle")
    before = trace.allocations.copy()
    result = analyzer.analyze(trace)
    pd.testing.assert_frame_equal(trace.allocations, before)
    assert result.trace is not trace and (result.trace.allocations["category"] != "unattributed").any()


def test_pandas_handles_answer_at_the_peak_of_the_lead_device() -> None:
    """Issue 33.1: the handles a pandas user guesses (a.allocations, a.at_peak(), a.by_category(), ...) read the
    labelled tables, at the peak, and sum to it; the loaded trace stays bare."""
    t = analyzer.load(SIM / "capacity_oom.pickle")
    a = analyzer.analyze(t)
    d = a.device(0)
    assert a.lead is d and set(t.allocations["category"].astype(str)) == {"unattributed"}
    assert "unattributed" not in set(a.allocations["category"].astype(str))
    for handle, rows in (("category", d.by_category), ("phase", d.by_phase)):
        series = getattr(a, f"by_{handle}")()
        assert isinstance(series, pd.Series) and series.index.name == handle
        assert series.to_dict() == {r["name"]: r["bytes"] for r in rows}
    assert int(a.by_module().sum()) == int(a.at_peak()["allocated_bytes"].sum()) == d.peak.allocated_bytes
    assert a.at_peak()["top_user_frame"].notna().all()
    before = a.live_at(d.peak.event_index - 1)
    made = d.peak.live[d.peak.live["seq_alloc"] == d.peak.event_index]["allocated_bytes"].sum()
    assert int(before["allocated_bytes"].sum()) + int(made) >= d.peak.allocated_bytes
    timeline = a.timeline()
    assert len(timeline) == d.trace_entries + 1 and timeline["allocated_bytes"].max() == d.peak.allocated_bytes
    assert timeline.loc[timeline["seq"] == d.peak.event_index, "phase"].item() == d.peak_phase
    try:
        a.at_peak(7)
    except KeyError as error:
        assert "devices: 0" in str(error)
    else:
        raise AssertionError("device 7 does not exist")
