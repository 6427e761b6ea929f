"""Property-based tests (hypothesis): valid allocator traces keep the analysis' invariants, and corrupted inputs
of every reader end in an AnalyzerError or a complete, self-consistent analysis.

Runs are bounded and reproducible (derandomize=True, no example database): the same examples in CI as here.
"""
from __future__ import annotations

import gzip
import io
import pickle
import tarfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings, strategies as st

from analyzer.errors import AnalyzerError
from hostile.generators import (
    allocator_runs,
    chrome_traces,
    corrupt,
    flip_bytes,
    json_bytes,
    memory_timelines,
    nsys_exports,
)
from hostile.pipeline import analyse_file, check_analysis, outcome

pytestmark = pytest.mark.usefixtures("in_process")  # thousands of inputs: read here (conftest.py)
FUZZ = settings(max_examples=200, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])
FEWER = settings(FUZZ, max_examples=150)


def _written(folder: Path, name: str, data: bytes) -> Path:
    path = folder / name
    path.write_bytes(data)
    return path


# ---- valid traces -------------------------------------------------------------------------------------------
@FEWER
@given(run=allocator_runs())
def test_valid_traces_keep_the_invariants(tmp_path_factory: pytest.TempPathFactory, run) -> None:
    """Totals are the sums of the live allocations, breakdowns sum to the peak, the replay ends in the final
    state, and for a complete history it starts from nothing and peaks where the allocator did."""
    path = _written(tmp_path_factory.mktemp("valid"), "run.pickle", pickle.dumps(run.snapshot, protocol=4))
    (analysis,) = analyse_file(path)
    check_analysis(analysis)
    trace, timeline = analysis.trace, analysis.trace.timeline
    assert {d.device for d in analysis.devices} >= {device for device, peak in run.peaks.items() if peak and run.complete}
    for d in analysis.devices:
        rows = timeline[timeline["device"] == d.device]
        end = trace.end_state(d.device)
        last = rows.iloc[-1]
        assert int(last["allocated_bytes"]) == end["allocated_bytes"]
        assert int(last["requested_bytes"]) == end["requested_bytes"]
        assert int(last["reserved_bytes"]) == end["reserved_bytes"]
        if run.complete:
            assert int(rows["allocated_bytes"].iloc[0]) == 0 and int(rows["reserved_bytes"].iloc[0]) == 0
            assert (rows["allocated_bytes"] <= rows["reserved_bytes"]).all()
            assert d.peak.allocated_bytes == run.peaks[d.device]
            assert not d.history_truncated


# ---- corrupted inputs, every reader ---------------------------------------------------------------------------
def _must_end_cleanly(path: Path, what: str) -> None:
    result = outcome(path)
    assert isinstance(result, (AnalyzerError, list)), what
    event(type(result).__name__ if isinstance(result, AnalyzerError) else "complete analysis")


@FUZZ
@given(run=allocator_runs(max_ops=15), data=st.data())
def test_corrupted_snapshots(tmp_path_factory: pytest.TempPathFactory, run, data: st.DataObject) -> None:
    done = [corrupt(data.draw, run.snapshot) for _ in range(data.draw(st.integers(1, 3)))]
    raw = pickle.dumps(run.snapshot, protocol=data.draw(st.sampled_from([2, 4])))
    if data.draw(st.booleans()):
        raw = flip_bytes(data.draw, raw)
        done.append("bytes flipped")
    name = data.draw(st.sampled_from(["s.pickle", "s.pickle.gz"]))
    raw = gzip.compress(raw, mtime=0) if name.endswith(".gz") else raw
    _must_end_cleanly(_written(tmp_path_factory.mktemp("snapshot"), name, raw), "; ".join(done))


@FUZZ
@given(trace=chrome_traces(), data=st.data())
def test_corrupted_chrome_traces(tmp_path_factory: pytest.TempPathFactory, trace: dict, data: st.DataObject) -> None:
    done = [corrupt(data.draw, trace) for _ in range(data.draw(st.integers(0, 3)))]
    raw = json_bytes(trace)
    if data.draw(st.booleans()):
        raw = flip_bytes(data.draw, raw)
        done.append("bytes flipped")
    folder = tmp_path_factory.mktemp("chrome")
    if data.draw(st.integers(0, 4)) == 0:  # a rank set: the same bytes inside a .tar.gz
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
            member = tarfile.TarInfo("rank0.pt.trace.json")
            member.size = len(raw)
            archive.addfile(member, io.BytesIO(raw))
        path = _written(folder, "ranks.tar.gz", buffer.getvalue())
    else:
        path = _written(folder, "t.pt.trace.json", raw)
    _must_end_cleanly(path, "; ".join(done))


@FUZZ
@given(timeline=memory_timelines(), data=st.data())
def test_corrupted_memory_timelines(tmp_path_factory: pytest.TempPathFactory, timeline: list,
                                    data: st.DataObject) -> None:
    done = [corrupt(data.draw, timeline) for _ in range(data.draw(st.integers(0, 2)))]
    raw = json_bytes(timeline)
    if data.draw(st.booleans()):
        raw = flip_bytes(data.draw, raw)
    _must_end_cleanly(_written(tmp_path_factory.mktemp("timeline"), "m.json", raw), "; ".join(done))


@FEWER
@given(export=nsys_exports(), data=st.data())
def test_corrupted_nsys_exports(tmp_path_factory: pytest.TempPathFactory, export: bytes, data: st.DataObject) -> None:
    if data.draw(st.integers(0, 3)) == 0:
        export = flip_bytes(data.draw, export)
    _must_end_cleanly(_written(tmp_path_factory.mktemp("nsys"), "n.sqlite", export), "nsys export")

