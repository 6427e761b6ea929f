"""The HTML explorer's embedded encoding (analyzer.report.interactive), decoded here as the page's script decodes
it: the live set at the peak and at every drawn moment equals the analysis' own, to the byte; past the budget
the live set stays exact at the peak, each OOM and each step's peak; the JSON cannot leave its script block; the
allocator pictures carry the numbers the JSON report holds; the module icicle sums to the peak."""
from __future__ import annotations

import functools
import json
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import analyzer
from analyzer.core.timeline import live_at
from analyzer.report import interactive
from analyzer.report.interactive import allocator_pictures, embed_json, module_icicle, page_data
from analyzer.report.view import build_view, worst_first
from analyzer.result import Analysis
from support.paths import FIXTURES, SIM


@functools.cache
def analysis(path: Path) -> Analysis:
    return analyzer.analyze(path)


def decode(data: dict[str, Any], index: int) -> dict[str, Any]:
    """One device's allocations and chart as report.js rebuilds them (cumulative sums of the differences)."""
    dev = data["devices"][index]
    al = dev["alloc"]
    born = np.cumsum(al["a"]) - 1
    end = np.where(np.asarray(al["l"]) == 0, np.iinfo(np.int64).max, born + np.asarray(al["l"]))
    chart = dev["chart"]
    return {"born": born, "end": end, "bytes": np.asarray(al["b"]), "text": data["text"], "m": al["m"],
            "c": al["c"], "seq": np.cumsum(chart["seq"]), "allocated": np.cumsum(chart["allocated"]),
            "stack": [np.cumsum(s) for s in chart["stack"]], "exact": dev["exact"]}


def live(d: dict[str, Any], seq: int) -> np.ndarray:
    return np.flatnonzero((d["born"] <= seq) & (d["end"] > seq))


@pytest.mark.parametrize("name", ["fragmentation", "capacity_oom", "gpt_activation_peak"])
def test_the_live_set_from_the_encoding_is_the_analysis_live_set(name: str) -> None:
    a = analysis(SIM / f"{name}.pickle")
    dev = a.devices[0]
    d = decode(page_data(a), 0)
    assert d["exact"] is None  # a fixture fits the budget: every moment is exact
    at_peak = live(d, dev.peak.event_index)
    assert int(d["bytes"][at_peak].sum()) == dev.peak.allocated_bytes
    expected = Counter(zip(dev.peak.live["allocated_bytes"].astype(int), dev.peak.live["module"].astype(str),
                           dev.peak.live["category"].astype(str), strict=True))
    decoded = Counter((int(d["bytes"][i]), d["text"][d["m"][i]], d["text"][d["c"][i]]) for i in at_peak)
    assert decoded == expected
    timeline = a.trace.timeline
    truth = dict(zip(timeline.loc[timeline["device"] == dev.device, "seq"],
                     timeline.loc[timeline["device"] == dev.device, "allocated_bytes"], strict=True))
    for k in range(0, len(d["seq"]), max(len(d["seq"]) // 40, 1)):  # forty moments across the chart
        seq = int(d["seq"][k])
        assert int(d["bytes"][live(d, seq)].sum()) == int(d["allocated"][k]) == int(truth[seq])
        assert sum(int(s[k]) for s in d["stack"]) == int(d["allocated"][k])  # the categories stack to the total


def test_past_the_budget_the_key_moments_stay_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    a = analysis(SIM / "fragmentation.pickle")
    dev = a.devices[0]
    total = int((a.trace.allocations["device"] == dev.device).sum())
    monkeypatch.setattr(interactive, "ALLOCATIONS_EMBEDDED", total)   # just fits: everything, exact everywhere
    assert page_data(a)["devices"][0]["exact"] is None
    keys = {dev.peak.event_index, *a.trace.ooms["seq"].astype(int), *(s["event_index"] for s in dev.steps)}
    rows = a.trace.allocations[a.trace.allocations["device"] == dev.device]
    key_rows = np.zeros(total, dtype=bool)
    for seq in keys:
        key_rows |= rows["alloc_id"].isin(live_at(a.trace, dev.device, seq)["alloc_id"]).to_numpy()
    budget = int(key_rows.sum()) + (total - int(key_rows.sum())) // 2
    monkeypatch.setattr(interactive, "ALLOCATIONS_EMBEDDED", budget)
    d = decode(page_data(a), 0)
    assert keys <= set(d["exact"]) and len(d["exact"]) > len(keys)   # and evenly spaced ones beside them
    assert int(key_rows.sum()) < len(d["born"]) <= budget < total    # bounded: the key moments, then the budget
    for seq in d["exact"]:
        assert int(d["bytes"][live(d, seq)].sum()) == int(live_at(a.trace, dev.device, seq)["allocated_bytes"].sum())


def test_embedded_json_cannot_leave_its_script_block() -> None:
    hostile = {"frame": "</script><script>alert(1)</script><!-- & \u2028\u2029 -->", "n": [1, 2]}
    text = embed_json(hostile)
    for raw in ("<", ">", "&", "\u2028", "\u2029"):
        assert raw not in text
    assert json.loads(text) == hostile


def test_input_strings_are_interned_visible() -> None:
    """Controls and bidi overrides in a frame reach the page escaped, as in every other report."""
    text = interactive._Interned()
    assert text("a\u202eb\x1b") == 0 and list(text.index) == ["a\\u202eb\\x1b"]
    assert text.many(["x", "a\u202eb\x1b", "x"]) == [1, 0, 1]


def test_allocator_pictures_hold_the_json_numbers() -> None:
    a = analysis(SIM / "fragmentation.pickle")
    dev = a.devices[0]
    peak, oom = allocator_pictures(dev)
    measured = a.to_json()["devices"][0]["fragmentation"]
    assert oom.event_index == dev.oom.event_index == measured["event_index"]
    assert oom.request_bytes == dev.oom.requested_bytes == measured["request_bytes"]
    assert oom.largest_free_block_bytes == measured["largest_free_block_bytes"]
    assert oom.request_fits_nowhere   # the fixture's story: fragmentation
    scale = max(max(b.bytes for b in oom.bars), oom.request_bytes)   # bars and the request share one scale
    assert oom.request_width == oom.request_bytes / scale and max(b.width for b in oom.bars) <= 1
    for bar in oom.bars:
        assert bar.used_bytes + bar.free_bytes == bar.bytes and bar.gradient.endswith("100.00%)")
    assert peak.event_index == dev.peak.event_index and peak.request_bytes is None
    assert not peak.request_fits_nowhere


def test_a_profiler_trace_records_no_segments() -> None:
    a = analysis(FIXTURES / "kineto" / "train.pt.trace.json.gz")
    assert all(allocator_pictures(d) is None for d in a.devices)


def test_segment_gradient_buckets_past_its_run_limit() -> None:
    import pandas as pd

    blocks = pd.DataFrame({"addr": np.arange(0, 4000, 2) * 512, "allocated_bytes": 512, "requested_bytes": 500})
    exact = interactive._gradient(0, 4000 * 512, blocks.head(10), 512)
    assert exact.count("%,") + 1 == 10 * 2 + 9 + 1  # each block (used, waste), the gaps between them, the tail
    bucketed = interactive._gradient(0, 4000 * 512, blocks, 512)
    assert bucketed.count("%,") + 1 <= interactive.RUN_BUCKETS and bucketed.endswith("100.00%)")


def test_module_icicle_sums_to_the_peak_with_its_categories() -> None:
    a = analysis(SIM / "gpt_activation_peak.pickle")
    dev = a.devices[0]
    roots = module_icicle(dev)
    assert sum(n.bytes for n in roots) == dev.peak.allocated_bytes
    assert abs(sum(n.width for n in roots) - 1) < 1e-9

    def walk(nodes: list) -> None:
        for n in nodes:
            assert abs(sum(share for _, _, share in n.categories) - 1) < 1e-9
            if n.children:
                assert sum(c.bytes for c in n.children) == n.bytes
                walk(n.children)

    walk(roots)


def test_devices_worst_first() -> None:
    view = build_view(analysis(SIM / "capacity_oom.pickle"))
    d = view.devices[0]
    calm = replace(d, device=1, oom=None, capacity_bytes=None, peak_allocated_bytes=d.peak_allocated_bytes * 2)
    full = replace(d, device=2, oom=None, capacity_bytes=d.peak_allocated_bytes, peak_allocated_bytes=d.peak_allocated_bytes)
    host = replace(d, device=-1)
    assert [x.device for x in worst_first([host, calm, full, d])] == [0, 2, 1, -1]


def test_a_reserved_line_is_drawn_only_where_the_input_records_it() -> None:
    """A memory timeline records no reserved bytes: no reserved series in the page's data, none in the static
    chart's points, no legend entry; a snapshot has all three."""
    from analyzer.report.html import render_html

    for path, recorded in [(FIXTURES / "kineto" / "train.memory_timeline.raw.json.gz", False),
                           (SIM / "healthy.pickle", True)]:
        a = analysis(path)
        chart = page_data(a)["devices"][0]["chart"]
        assert (chart["reserved"] is not None) is recorded
        view = build_view(a)
        assert ("reserved_bytes" in view.devices[0].chart.points) is recorded
        page = render_html(a)
        assert ('<span class="swatch line"></span>reserved' in page) is recorded
