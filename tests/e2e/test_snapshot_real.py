"""Every real snapshot in ../shared/real loads, is analysed, and agrees with independent computations."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import analyzer
from analyzer.core.trace import TABLES
from support.independent import read_snapshot, requested_peak, segment_sums
from support.paths import REAL, real_snapshots

SNAPSHOTS = real_snapshots() or [pytest.param(None, marks=pytest.mark.skip(reason=f"no real snapshots at {REAL}"))]


def _id(p):
    return str(p.relative_to(REAL)) if isinstance(p, Path) else "absent"


@pytest.mark.parametrize("path", SNAPSHOTS, ids=_id)
def test_real_snapshot_matches_independent_replay(path: Path) -> None:
    trace = analyzer.load(path)
    result = analyzer.analyze(trace)
    raw = read_snapshot(path)
    sums = segment_sums(raw)
    consistent = all(s["allocated_size"] == sum(b["size"] for b in s["blocks"] if b["state"] == "active_allocated")
                     for s in raw["segments"])
    if not consistent:  # a synthetic file (mosaic's test fixture): the reader must say so, and trusts the blocks
        assert any("inconsistent" in w for w in result.warnings)
    for d in result.devices:
        allocated, reserved, requested = sums.get(d.device, (0, 0, 0))
        if not consistent:
            allocated = sum(b["size"] for s in raw["segments"] if s["device"] == d.device
                            for b in s["blocks"] if b["state"] == "active_allocated")
        assert d.end["allocated_bytes"] == allocated
        assert d.end["reserved_bytes"] == reserved
        timeline = trace.timeline[trace.timeline["device"] == d.device]
        assert int(timeline["allocated_bytes"].iloc[-1]) == allocated, "replay does not reach the end state"
        assert int(timeline["requested_bytes"].max()) == requested_peak(raw, d.device)
        # at the peak, the total is exactly the sum of the live allocations
        assert int(d.peak.live["allocated_bytes"].sum()) == d.peak.allocated_bytes
        assert d.peak.allocated_bytes >= allocated
    for name, columns in TABLES.items():
        assert list(getattr(trace, name).columns) == list(columns)


def test_oom_found_on_device_1(real_dir: Path, tmp_path: Path) -> None:
    path = real_dir / "constructor-sun-code_location" / "memory_snapshot.pickle"
    out = tmp_path / "r.json"
    run = subprocess.run([sys.executable, "-m", "analyzer", str(path), "--format", "json", "-o", str(out), "-q"],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    report = json.loads(out.read_text())
    assert report["schema"] == "analyzer/1"
    by_device = {d["device"]: d for d in report["devices"]}
    assert by_device[1]["oom"]["requested_bytes"] == 5308694528
    assert by_device[1]["oom"]["device_free_bytes"] == 95682560
    assert by_device[0]["oom"] is None and by_device[2]["oom"] is None
    assert report["allocator_settings"]["expandable_segments"] is True
    # the OOM request came from the user's model code, not from torch internals
    assert by_device[1]["oom"]["top_user_frame"].endswith("update_nodes")


def test_torch_2_0_block_history(real_dir: Path) -> None:
    trace = analyzer.load(real_dir / "yiyi-llm-inference" / "oom_snapshot.pickle")
    assert trace.torch_era.startswith("torch 2.0")
    assert not trace.has_history
    live = trace.allocations
    assert (live["origin"] == "end_state").all() and len(live) == 460
    # 2.0 blocks have no address: they are laid out in order from the segment start
    blocks = trace.blocks.sort_values(["segment_addr", "addr"])
    first = blocks.groupby("segment_addr").head(1)
    assert (first["addr"] == first["segment_addr"]).all()
    assert live["stack_id"].notna().all(), "frames come from the block history"


def test_bare_list_of_segments(real_dir: Path) -> None:
    trace = analyzer.load(real_dir / "muduard-layoutediting" / "memory_snapshot.pkl")
    assert trace.torch_era.startswith("legacy")
    assert list(trace.devices) == [1]
    assert int(trace.segments["alive_at_end"].sum()) == 255
    result = analyzer.analyze(trace)
    assert any("no allocation history" in w for w in result.warnings)


def test_truncated_history_is_seeded_and_reported(real_dir: Path) -> None:
    # the trace starts with 1,119 segment_free entries: the recording began after those segments existed
    result = analyzer.analyze(real_dir / "kkaitlyn111-cs336-a2" / "memory_ctx512_forward.pickle")
    d = result.device(0)
    assert d.history_truncated
    assert any("already allocated before the first recorded event" in w for w in result.warnings)
    timeline = result.trace.timeline
    assert (timeline["reserved_bytes"] >= 0).all() and (timeline["allocated_bytes"] >= 0).all()


def test_snapshot_without_history_reports_end_state(real_dir: Path) -> None:
    path = real_dir / "kkaitlyn111-cs336-a2" / "memory_snapshot.pickle"
    d = analyzer.analyze(path).device(0)
    allocated, reserved, _ = segment_sums(read_snapshot(path))[0]
    assert (d.end["allocated_bytes"], d.end["reserved_bytes"]) == (allocated, reserved)
    largest = max(b["size"] for s in read_snapshot(path)["segments"] for b in s["blocks"] if b["state"] == "inactive")
    assert d.end["largest_free_block_bytes"] == largest
    assert d.end["inactive_bytes"] == reserved - allocated - sum(
        b["size"] for s in read_snapshot(path)["segments"] for b in s["blocks"] if b["state"] == "active_pending_free")
