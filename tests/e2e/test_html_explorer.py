"""The HTML report's explorer in real headless Chromium, driven as a person would (mouse and keyboard over the
DevTools protocol): it loads nothing and logs no error, hovering shows a value, a click on the chart lists what
was live at the clicked moment (checked against the pandas API's live set at that event and the timeline), search
filters, the segment view shows the OOM's request and largest free block as the JSON holds them, and strings
from a hostile input stay text in the explorer's tables and stacks."""
from __future__ import annotations

import functools
import os
import pickle
from pathlib import Path
from typing import Any

import pytest

import analyzer
from analyzer.core.timeline import live_at
from analyzer.report.html import write_html
from analyzer.result import Analysis
from support.chromium import Chromium, chromium_binary
from support.paths import FIXTURES, SIM

SCRIPT = "<script>alert(1)</script>"
IMG = "<img src=x onerror=alert(1)>"


@functools.cache
def analysis(path: Path) -> Analysis:
    return analyzer.analyze(path)


@pytest.fixture(scope="module")
def browser():
    binary = chromium_binary()
    if binary is None:
        pytest.skip("chromium is not installed (apt-get install chromium); CI installs it in .ci/run")
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(4)]  # the browser's fds 3 and 4 must exist
    with Chromium(binary) as b:
        yield b
    for fd in held:
        os.close(fd)


def _open(browser: Chromium, a: Analysis, page: Path) -> None:
    write_html(a, page)
    record = browser.open(page.as_uri())
    assert record.errors() == []
    assert record.requests == [page.as_uri()], "the report must request nothing but itself"


def _state(browser: Chromium, device: int = 0) -> dict[str, Any]:
    return browser.evaluate(f"Object.assign({{}}, document.getElementById('explore-{device}').dataset)")


def _chart_box(browser: Chromium, device: int = 0) -> dict[str, float]:
    browser.evaluate(f"document.getElementById('explore-{device}').scrollIntoView()")
    return browser.evaluate(f"(() => {{ const r = document.querySelector('#explore-{device} .u-over')"
                            ".getBoundingClientRect(); return {x: r.x, y: r.y, w: r.width, h: r.height}; })()")


def _mouse(browser: Chromium, kind: str, x: float, y: float) -> None:
    extra = {"button": "left", "clickCount": 1} if kind != "mouseMoved" else {}
    browser.call("Input.dispatchMouseEvent", type=kind, x=x, y=y, **extra)


def _live_bytes(a: Analysis, seq: int) -> tuple[int, int]:
    live = live_at(a.trace, a.devices[0].device, seq)
    return int(live["allocated_bytes"].sum()), len(live)


def test_hover_and_click_list_what_was_live_then(browser: Chromium, tmp_path: Path) -> None:
    a = analysis(SIM / "fragmentation.pickle")
    _open(browser, a, tmp_path / "report.html")
    d = a.devices[0]
    assert browser.evaluate("document.querySelectorAll('#explore-0 canvas').length") >= 1
    state = _state(browser)   # on load: the peak
    assert int(state["seq"]) == d.peak.event_index and int(state["liveBytes"]) == d.peak.allocated_bytes
    assert int(state["liveCount"]) == len(d.peak.live)
    box = _chart_box(browser)
    timeline = a.trace.timeline
    allocated = dict(zip(timeline["seq"], timeline["allocated_bytes"], strict=True))
    for share in (0.3, 0.62):
        x, y = box["x"] + box["w"] * share, box["y"] + box["h"] / 2
        _mouse(browser, "mouseMoved", x, y)
        readout = browser.evaluate("document.querySelector('#explore-0 .readout').textContent")
        assert "allocated" in readout and "reserved" in readout and "event" in readout
        _mouse(browser, "mousePressed", x, y)
        _mouse(browser, "mouseReleased", x, y)
        state = _state(browser)
        seq = int(state["seq"])
        assert seq != d.peak.event_index
        assert f"event {seq}" in readout  # the moment hovered is the moment listed
        assert (int(state["liveBytes"]), int(state["liveCount"])) == _live_bytes(a, seq)
        assert int(state["liveBytes"]) == int(allocated[seq])   # the timeline's value there
        assert f"allocator event {seq}" in browser.evaluate("document.querySelector('#explore-0 .moment').textContent")


def test_keyboard_moves_and_selects(browser: Chromium, tmp_path: Path) -> None:
    a = analysis(SIM / "capacity_oom.pickle")
    _open(browser, a, tmp_path / "report.html")
    browser.evaluate("document.querySelector('#explore-0 .uchart').focus()")
    for key in ("Home", "ArrowRight", "ArrowRight", "Enter"):
        browser.call("Input.dispatchKeyEvent", type="keyDown", key=key, code=key,
                     windowsVirtualKeyCode={"Home": 36, "ArrowRight": 39, "Enter": 13}[key])
        browser.call("Input.dispatchKeyEvent", type="keyUp", key=key, code=key)
    state = _state(browser)
    seq = browser.evaluate("document.getElementById('explore-0').explorer.d.chart.seq[2]")
    assert int(state["seq"]) == seq
    assert (int(state["liveBytes"]), int(state["liveCount"])) == _live_bytes(a, seq)


def test_search_and_grouping_filter_the_live_set(browser: Chromium, tmp_path: Path) -> None:
    a = analysis(SIM / "fragmentation.pickle")
    _open(browser, a, tmp_path / "report.html")
    live = a.devices[0].peak.live
    query = "layers.3.attn"
    browser.evaluate(f"(() => {{ const s = document.querySelector('#explore-0 input.search'); s.value = {query!r};"
                     " s.dispatchEvent(new Event('input')); })()")
    state = _state(browser)
    match = live[live["module"].astype(str).str.lower().str.contains(query, regex=False)]
    assert 0 < len(match) < len(live)
    assert (int(state["shownBytes"]), int(state["shownCount"])) == (int(match["allocated_bytes"].sum()), len(match))
    groups = browser.evaluate("[...document.querySelectorAll('#explore-0 tr.group-row')].length")
    assert groups == match["module"].nunique()
    browser.evaluate("(() => { const g = document.querySelector('#explore-0 select.group'); g.value = 'category';"
                     " g.dispatchEvent(new Event('change')); })()")
    names = browser.evaluate("[...document.querySelectorAll('#explore-0 .group-toggle')].map(b => b.textContent)")
    assert len(names) == match["category"].nunique()
    browser.evaluate("document.querySelector('#explore-0 .group-toggle').click()")
    rows = browser.evaluate("document.querySelectorAll('#explore-0 tr.item-row').length")
    assert rows == int((match["category"].astype(str).str.replace("_", " ") == names[0][2:]).sum())


def test_segment_view_shows_the_request_and_the_largest_free_block(browser: Chromium, tmp_path: Path) -> None:
    a = analysis(SIM / "fragmentation.pickle")
    _open(browser, a, tmp_path / "report.html")
    measured = a.to_json()["devices"][0]["fragmentation"]
    requests = browser.evaluate("[...document.querySelectorAll('#allocator-0 .request-bytes')].map(e => e.dataset.bytes)")
    largest = browser.evaluate("[...document.querySelectorAll('#allocator-0 .largest-free')].map(e => e.dataset.bytes)")
    assert requests == [str(measured["request_bytes"])]
    assert largest[-1] == str(measured["largest_free_block_bytes"])  # the last picture is the OOM's
    assert browser.evaluate("document.querySelectorAll('#allocator-0 .seg-bar').length") > 2


def test_a_profiler_trace_says_segments_are_not_recorded(browser: Chromium, tmp_path: Path) -> None:
    a = analysis(FIXTURES / "kineto" / "train.pt.trace.json.gz")
    _open(browser, a, tmp_path / "report.html")
    for d in a.devices:
        text = browser.evaluate(f"document.getElementById('allocator-{d.device}').innerText")
        assert "not recorded" in text
        assert int(_state(browser, d.device)["liveBytes"]) == d.peak.allocated_bytes


def test_a_memory_timeline_draws_no_reserved_line(browser: Chromium, tmp_path: Path) -> None:
    """It records no reserved bytes: the chart has no reserved series and the readout says so."""
    a = analysis(FIXTURES / "kineto" / "train.memory_timeline.raw.json.gz")
    _open(browser, a, tmp_path / "report.html")
    box = _chart_box(browser)
    _mouse(browser, "mouseMoved", box["x"] + box["w"] * 0.5, box["y"] + box["h"] / 2)
    readout = browser.evaluate("document.querySelector('#explore-0 .readout').textContent")
    assert "allocated" in readout and "reserved not recorded" in readout


def test_hostile_strings_stay_text_in_the_explorer(browser: Chromium, tmp_path: Path) -> None:
    frames = [{"filename": f"/home/u/{IMG}.py", "line": 12, "name": SCRIPT},
              {"filename": "/home/u/train.py", "line": 30, "name": "main"}]
    base = 0x7F0000000000
    trace = [{"action": "segment_alloc", "addr": base, "size": 8 << 20, "stream": 0, "time_us": 1, "frames": frames}]
    trace += [{"action": "alloc", "addr": base + i * (1 << 20), "size": 1 << 20, "stream": 0, "time_us": 2 + i,
               "frames": frames, "user_metadata": f"module::forward::{IMG}\u2028{SCRIPT}"} for i in range(3)]
    blocks = [{"address": base + i * (1 << 20), "size": 1 << 20, "requested_size": 1 << 20,
               "state": "active_allocated", "frames": frames} for i in range(3)]
    blocks.append({"address": base + (3 << 20), "size": 5 << 20, "requested_size": 0, "state": "inactive",
                   "frames": []})
    snapshot = {"segments": [{"device": 0, "address": base, "total_size": 8 << 20, "allocated_size": 3 << 20,
                              "active_size": 3 << 20, "requested_size": 3 << 20, "stream": 0,
                              "segment_type": "large", "segment_pool_id": (0, 0), "is_expandable": False,
                              "frames": frames, "blocks": blocks}],
                "device_traces": [trace], "allocator_settings": {},
                "external_annotations": [{"device": 0, "name": f"module::forward::{IMG}", "stage": s, "time_us": t}
                                         for s, t in (("START", 1), ("END", 9))]}
    path = tmp_path / "hostile.pickle"
    path.write_bytes(pickle.dumps(snapshot, protocol=4))
    a = analyzer.analyze(path)
    page = tmp_path / "hostile.html"
    _open(browser, a, page)
    html = page.read_text(encoding="utf-8")
    data = html[html.index('id="report-data">'):]
    data = data[:data.index("</script>")]
    assert "<" not in data[len('id="report-data">'):] and "\u2028" not in data
    browser.evaluate("(() => { const g = document.querySelector('#explore-0 select.group'); g.value = 'site';"
                     " g.dispatchEvent(new Event('change')); })()")
    browser.evaluate("document.querySelector('#explore-0 .group-toggle').click()")
    browser.evaluate("(() => { const d = document.querySelector('#explore-0 details.alloc'); d.open = true; })()")
    browser.evaluate("new Promise(r => setTimeout(r, 50))")
    assert browser.evaluate("document.querySelectorAll('img').length") == 0
    assert browser.evaluate("document.scripts.length") == 2  # the data block and ours, allowed by its hash
    text = browser.evaluate("document.getElementById('explore-0').innerText")
    assert SCRIPT in text and IMG in text
    assert browser.evaluate("document.querySelectorAll('#explore-0 strong.frame').length") >= 1  # the user's frame


def test_the_explorer_shows_the_category_in_force_at_the_moment(browser: Chromium, tmp_path: Path, real_dir) -> None:
    """zidongliu's peak is the moment the estimator's new K is made before the old one is freed: the explorer,
    like the pandas API, lists it as a temporary then (`category_from_seq`), so the state is counted once."""
    a = analysis(real_dir / "zidongliu-decomfl/memory.pickle")
    _open(browser, a, tmp_path / "report.html")
    live = a.devices[0].peak.live
    assert live["category_from_seq"].notna().any()
    for category in ("optimizer_state", "temporary"):
        browser.evaluate(f"(() => {{ const s = document.querySelector('#explore-0 input.search'); s.value = {category!r};"
                         " s.dispatchEvent(new Event('input')); })()")
        expected = live[live["category"].astype(str) == category]
        state = _state(browser)
        assert (int(state["shownBytes"]), int(state["shownCount"])) == (int(expected["allocated_bytes"].sum()),
                                                                         len(expected)), category


@pytest.mark.parametrize("width", [800, 1400])
def test_chart_ticks_are_round_binary_sizes_and_never_clipped(browser: Chromium, tmp_path: Path, width: int) -> None:
    """Issue 33.5: the y ticks sit at round values of one binary unit (0, 5, 10, 15, 20 GiB; never 18.63 GiB at a
    decimal-GB position), every label fits the axis at 800 and 1400 px, and the default x axis is the events',
    where the peak and the OOM are apart (on the clock they are milliseconds in seconds)."""
    import re

    a = analysis(SIM / "capacity_oom.pickle")
    page = tmp_path / "report.html"
    write_html(a, page)
    record = browser.open(page.as_uri(), width=width)
    assert record.errors() == []
    box = browser.evaluate("Object.assign({}, document.querySelector('#explore-0 .uchart').dataset)")
    assert box["xAxis"] == "seq" and browser.evaluate("document.querySelector('#explore-0 select.xaxis').value") == "seq"
    labels = box["yTicks"].split("|")
    assert len(labels) >= 3, labels
    values = []
    for label in labels:
        match = re.fullmatch(r"(\d+(?:\.\d+)?) (B|KiB|MiB|GiB|TiB)", label)
        assert match, label
        values.append(float(match.group(1)))
        assert float(match.group(1)) * 4 == int(float(match.group(1)) * 4), f"{label} is not a round size"
    steps = {b - a for a, b in zip(values, values[1:], strict=False)}
    assert len(steps) == 1 and values[0] == 0, labels   # evenly spaced from zero
    widest = browser.evaluate("(() => { const c = document.createElement('canvas').getContext('2d'); "
                              "c.font = '12px system-ui, -apple-system, \"Segoe UI\", Roboto, sans-serif'; "
                              f"return Math.max(...{labels!r}.map((t) => c.measureText(t).width)); }})()")
    assert widest + 15 <= float(box["yAxisWidth"]), (widest, box["yAxisWidth"])   # tick and gap: 15 px
