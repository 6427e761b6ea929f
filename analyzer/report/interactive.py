"""What the HTML report's script needs to let a reader dig in: the timeline per device, every allocation as an
interval, and interned labels and stacks, as one compact JSON document the page computes live sets from.

The encoding (a `devices` list and shared `text` table; every label is an index into `text`):

- `chart`: the timeline thinned for drawing (each bucket's lowest and highest row, the peak, every OOM and every
  step's peak kept exactly): `seq`, `t` (µs since the first event, `null` when the input has no times),
  `allocated`, `reserved` (null where the input records no reserved bytes) and one series of allocated bytes
  per category in `stack` (bottom first), each as differences from the point before; and per point the `phase`, `step` and `module` in force;
- `alloc`: one entry per allocation, ordered by the event that made it: `a` that event's seq as a difference from
  the previous entry's (the first from -1; -1 itself means "made before the recording"), `l` its lifetime in
  events (0: alive at the end), `b` allocated bytes, `c`/`m`/`p` category, module, phase and `s` its stack (-1:
  none). An allocation is live just after event `seq` when `a <= seq < a + l` (or `l == 0`). `f` lists
  `[entry, seq]` for the few whose category holds only from event `seq` on (`category_from_seq`): before it
  they are `ft` (temporary);
- `phase_colors`: the colour of each phase the bands name;
- `stacks`: `[site, op, frames left out, frame, frame, ...]`, Python frames innermost first, a user frame as its
  index bitwise-negated (`~i`), so the page can embolden it;
- `exact`: `null` when every allocation of the device is embedded (the live set at any moment is exact); for huge
  inputs the seqs where the live set is exact: the peak, each OOM, each step's peak, then evenly spaced moments
  while their allocations fit ALLOCATIONS_EMBEDDED. A click elsewhere shows the nearest of them, and says so.

Every string from the input is passed through `visible` (controls and bidi overrides escaped) and the document is
made safe to sit in a `<script type="application/json">` block (`embed_json`); the page inserts text with
`textContent`, never as markup.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson
import pandas as pd

from analyzer.core.module_tree import OWN, ModuleNode
from analyzer.core.printable import visible
from analyzer.core.stacks import format_frame, is_python_frame, is_user_frame
from analyzer.core.timeline import downsample
from analyzer.core.vocabulary import (
    MODULE_PATH_SEPARATOR,
    UNATTRIBUTED,
    Category,
    category_color,
    category_rank,
    phase_color,
)
from analyzer.result import Analysis, DeviceAnalysis, SegmentsAt

CHART_POINTS = (2000, 6000, 12000)   # interactive timeline rows per device: at least, at most, all devices together
ALLOCATIONS_EMBEDDED = 60_000        # allocations embedded for all devices together (each about 30 bytes of JSON)
SAMPLE_MOMENTS = 256                 # evenly spaced moments tried for an exact live set when not all fit
FRAMES_EMBEDDED = 40                 # Python frames of a stack, innermost first
STEP_MARKS = 200                     # step starts marked on the chart
RUNS_EXACT = 240                     # a segment with more blocks and gaps than this is drawn in RUN_BUCKETS buckets
RUN_BUCKETS = 200
ICICLE_DEPTH = 6
WASTE_COLOR, FREE_COLOR, LARGEST_FREE_COLOR = "#e69f00", "#e4e8ee", "#009e73"
USED_COLORS = ("#3b6fc4", "#1f4e9c")  # neighbouring blocks alternate, so each block shows


class _Interned:
    """One table of strings; each string is stored once and referred to by its index."""

    def __init__(self) -> None:
        self.index: dict[str, int] = {}

    def __call__(self, text: object) -> int:
        key = visible(str(text))
        if key not in self.index:
            self.index[key] = len(self.index)
        return self.index[key]

    def many(self, values: Any) -> list[int]:
        codes = {v: self(v) for v in pd.unique(np.asarray(values, dtype=object))}
        return [codes[v] for v in values]


def embed_json(document: Any) -> str:
    """JSON that cannot end or change the `<script type="application/json">` block it sits in: `<`, `>` and `&`
    as \\u escapes (no `</script>`, no `<!--`), and U+2028/2029 escaped for old JavaScript parsers."""
    text = orjson.dumps(document).decode()
    for raw, escaped in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"), ("\u2028", "\\u2028"),
                         ("\u2029", "\\u2029")):
        text = text.replace(raw, escaped)
    return text


def page_data(analysis: Analysis) -> dict[str, Any]:
    """The document the report's script reads (see the module docstring)."""
    text, stacks = _Interned(), _Stacks(analysis)
    n = max(len(analysis.devices), 1)
    low, high, budget = CHART_POINTS
    points = min(high, max(low, budget // n))
    devices = [_device(analysis, d, text, stacks, points, ALLOCATIONS_EMBEDDED // n) for d in analysis.devices]
    stacks.finish(text)
    names = list(text.index)
    bands = {band[2] for device in devices if device["chart"] for band in device["chart"]["bands"]}
    return {"devices": devices, "stacks": stacks.rows, "text": names,
            "phase_colors": {str(i): phase_color(names[i]) for i in sorted(bands)}}


class _Stacks:
    """The stacks embedded allocations refer to, numbered in the order first used."""

    def __init__(self, analysis: Analysis) -> None:
        self.table = analysis.trace.stacks
        self.number: dict[int, int] = {}
        self.rows: list[list[int]] = []

    def many(self, stack_ids: np.ndarray) -> list[int]:
        out = []
        for s in stack_ids.tolist():
            if s < 0:
                out.append(-1)
                continue
            out.append(self.number.setdefault(s, len(self.number)))
        return out

    def finish(self, text: _Interned) -> None:
        for stack_id in self.number:  # dicts keep insertion order: row i is the stack numbered i
            frames = [f for f in self.table["frames"].iat[stack_id] if is_python_frame(f)]
            site, op = self.table["top_user_frame"].iat[stack_id], self.table["op"].iat[stack_id]
            row = [-1 if site is None else text(site), -1 if op is None else text(op),
                   max(len(frames) - FRAMES_EMBEDDED, 0)]
            row += [~text(format_frame(f)) if is_user_frame(f) else text(format_frame(f))
                    for f in frames[:FRAMES_EMBEDDED]]
            self.rows.append(row)


def _key_moments(analysis: Analysis, d: DeviceAnalysis) -> list[int]:
    """The peak, every OOM and every step's peak: the moments whose live set is always exact."""
    ooms = analysis.trace.ooms
    oom_seqs = ooms.loc[ooms["device"] == d.device, "seq"].astype(int).tolist()
    return sorted({d.peak.event_index, *oom_seqs, *(int(s["event_index"]) for s in d.steps)})


def _device(analysis: Analysis, d: DeviceAnalysis, text: _Interned, stacks: _Stacks, points: int,
            embedded: int) -> dict[str, Any]:
    trace = analysis.trace
    rows = trace.allocations[trace.allocations["device"] == d.device]
    born = rows["seq_alloc"].to_numpy(dtype=np.float64, na_value=-1).astype(np.int64)
    freed = rows["seq_free"].to_numpy(dtype=np.float64, na_value=-1).astype(np.int64)
    end = np.where(freed < 0, np.iinfo(np.int64).max, freed)
    keys = _key_moments(analysis, d)
    chosen, exact = _embedded_rows(born, end, keys, d.trace_entries, embedded)
    order = chosen[np.argsort(born[chosen], kind="stable")]
    sub = rows.iloc[order]
    a = born[order]
    lifetime = np.where(end[order] == np.iinfo(np.int64).max, 0, end[order] - a)
    return {
        "device": d.device, "name": trace.device_label(d.device),
        "peak": d.peak.event_index, "peak_bytes": d.peak.allocated_bytes,
        "chart": _chart(analysis, d, text, points, keys) if d.trace_entries else None,
        "alloc": {
            "a": np.diff(a, prepend=-1).tolist(), "l": lifetime.tolist(),
            "b": sub["allocated_bytes"].to_numpy(dtype=np.int64).tolist(),
            "c": text.many(sub["category"].astype(str).to_numpy()),
            "m": text.many(sub["module"].astype(str).to_numpy()),
            "p": text.many(sub["phase"].astype(str).to_numpy()),
            "s": stacks.many(sub["stack_id"].to_numpy(dtype=np.float64, na_value=-1).astype(np.int64)),
            "f": _settling(sub["category_from_seq"]), "ft": text(Category.TEMPORARY.value),
        },
        "exact": exact, "allocations": len(rows),
    }


def _settling(category_from_seq: pd.Series) -> list[list[int]]:
    """[entry, seq] for each allocation whose category holds only from event `seq` on (a temporary before it)."""
    settles = category_from_seq.to_numpy(dtype=np.float64, na_value=np.nan)
    return [[int(i), int(settles[i])] for i in np.flatnonzero(~np.isnan(settles))]


def _embedded_rows(born: np.ndarray, end: np.ndarray, keys: list[int], entries: int,
                   budget: int) -> tuple[np.ndarray, list[int] | None]:
    """(positions of the allocations to embed, the moments whose live set is exact, None for all of them)."""
    if len(born) <= budget:
        return np.arange(len(born)), None
    keep = np.zeros(len(born), dtype=bool)
    for seq in keys:  # always exact, whatever they cost
        keep |= (born <= seq) & (end > seq)
    moments = list(keys)
    for seq in _evenly_spaced(entries):
        grown = keep | ((born <= seq) & (end > seq))
        if grown.sum() > budget:
            break
        keep = grown
        moments.append(seq)
    return np.flatnonzero(keep), sorted(set(moments))


def _evenly_spaced(entries: int) -> list[int]:
    """Up to SAMPLE_MOMENTS seqs, coarse to fine (halves, quarters, eighths ...), so a cut-off keeps them even."""
    out: list[int] = []
    level = 1
    while len(out) < SAMPLE_MOMENTS and 2**level <= 2 * SAMPLE_MOMENTS:
        for k in range(1, 2**level, 2):
            seq = entries * k // 2**level
            if len(out) < SAMPLE_MOMENTS and seq not in out:
                out.append(seq)
        level += 1
    return out


def _chart(analysis: Analysis, d: DeviceAnalysis, text: _Interned, max_points: int,
           keys: list[int]) -> dict[str, Any]:
    trace = analysis.trace
    timeline = trace.timeline[trace.timeline["device"] == d.device].reset_index(drop=True)
    drawn = downsample(timeline, max_points)
    positions = np.union1d(drawn.index.to_numpy(), np.asarray(keys, dtype=np.int64) + 1)  # row of seq s is s + 1
    points = timeline.iloc[positions[positions < len(timeline)]]
    seq = points["seq"].to_numpy(dtype=np.int64)
    columns = [c for c in timeline.columns if c.endswith("_bytes") and c not in
               ("allocated_bytes", "requested_bytes", "reserved_bytes") and timeline[c].any()]
    categories = sorted((c[: -len("_bytes")] for c in columns), key=category_rank)
    times = points["t_us"].astype("Float64").ffill().bfill()
    origin = trace.time_origin_us
    labels = d.labels
    at = np.clip(seq, 0, max(len(labels) - 1, 0))
    phase = labels["phase"].to_numpy(dtype=object)[at] if len(labels) else np.full(len(seq), None)
    step = labels["step"].to_numpy(dtype=np.float64)[at] if len(labels) else np.full(len(seq), np.nan)
    made = trace.allocations[(trace.allocations["device"] == d.device) & trace.allocations["seq_alloc"].notna()]
    made = made.sort_values("seq_alloc", kind="stable")
    latest = np.searchsorted(made["seq_alloc"].to_numpy(dtype=np.int64), seq, side="right") - 1
    modules = made["module"].astype(str).to_numpy()
    return {
        "seq": _delta(seq),
        "t": None if times.isna().all() or origin is None else _delta(times.to_numpy(dtype=np.float64) - origin),
        "reserved": _delta(points["reserved_bytes"]) if d.reserved_recorded else None,   # none: not recorded
        "allocated": _delta(points["allocated_bytes"]),
        "categories": [{"name": text(c), "color": category_color(c)} for c in categories],
        "stack": [_delta(points[f"{c}_bytes"]) for c in categories],
        "phase": [-1 if seq[i] < 0 or p is None or pd.isna(p) else text(p) for i, p in enumerate(phase)],
        "step": [None if s < 0 or np.isnan(st) or st < 0 else int(st) for s, st in zip(seq, step, strict=True)],
        "module": [-1 if i < 0 else text(modules[i]) for i in latest.tolist()],
        "bands": _bands(labels, text),
        "steps": _step_starts(labels),
        "ooms": sorted(set(trace.ooms.loc[trace.ooms["device"] == d.device, "seq"].astype(int).tolist())),
        "capacity": d.capacity_bytes,
    }


def _delta(values: Any) -> list[int]:
    """A series as its first value and the change at each later point (mostly 0: one event changes one
    category), which the page sums back."""
    return np.diff(np.asarray(values, dtype=np.int64), prepend=0).tolist()


def _bands(labels: pd.DataFrame, text: _Interned) -> list[list[int]]:
    """[start seq, end seq, phase] of every run of one phase (the page merges runs too narrow to see)."""
    if labels.empty:
        return []
    phase = labels["phase"].astype(object).where(labels["phase"].notna(), UNATTRIBUTED).astype(str).to_numpy()
    starts = np.flatnonzero(np.r_[True, phase[1:] != phase[:-1]])
    ends = np.r_[starts[1:], len(phase)]
    return [[int(s), int(e), text(phase[s])] for s, e in zip(starts, ends, strict=True) if phase[s] != UNATTRIBUTED]


def _step_starts(labels: pd.DataFrame) -> list[list[int]]:
    """[seq, step] where each step begins, at most STEP_MARKS of them (evenly thinned past that)."""
    if labels.empty:
        return []
    step = labels["step"].to_numpy(dtype=np.float64)
    step = np.where(np.isnan(step), -1, step)
    starts = np.flatnonzero((step >= 0) & np.r_[True, step[1:] != step[:-1]])
    if len(starts) > STEP_MARKS:
        starts = starts[np.linspace(0, len(starts) - 1, STEP_MARKS).astype(int)]
    return [[int(s), int(step[s])] for s in starts]


# --- the allocator's segments at the peak and at each OOM (drawn by the template, printed too) -----------------

@dataclass
class SegmentBar:
    bytes: int
    used_bytes: int
    waste_bytes: int
    free_bytes: int
    largest_free_bytes: int
    width: float             # of the widest bar in the picture (the request included), 0..1
    gradient: str            # CSS linear-gradient of its blocks: used, rounding waste, free, the largest free block


@dataclass
class AllocatorPicture:
    title: str               # "at the peak" / "at the out-of-memory (event N)"
    event_index: int
    reserved_bytes: int
    allocated_bytes: int
    internal_bytes: int      # rounding waste: allocated − requested of the live blocks
    external_bytes: int | None
    largest_free_block_bytes: int | None
    request_bytes: int | None
    request_width: float     # the failed request on the bars' scale
    segments: int
    bars: list[SegmentBar] = field(default_factory=list)

    @property
    def request_fits_nowhere(self) -> bool:
        return (self.request_bytes is not None and self.largest_free_block_bytes is not None
                and self.request_bytes > self.largest_free_block_bytes)


def allocator_pictures(d: DeviceAnalysis) -> list[AllocatorPicture] | None:
    """The segments and their blocks at the peak and at the last OOMs the analysis pictured
    (analyzer.diagnose.fragmentation.segments_pictured); None where the input records no segments."""
    return None if d.segments_pictured is None else [_picture(m) for m in d.segments_pictured]


def _picture(moment: SegmentsAt) -> AllocatorPicture:
    measured, shown, live = moment.measured, moment.segments, moment.live
    request = measured.request_bytes
    scale = max(int(shown["bytes"].max()) if len(shown) else 1, request or 0, 1)
    addr = live["addr"].to_numpy(dtype=np.int64)
    bars = []
    for s in shown.itertuples():
        inside = live.iloc[np.searchsorted(addr, s.addr):np.searchsorted(addr, s.end)]
        waste = int((inside["allocated_bytes"] - inside["requested_bytes"]).sum())
        bars.append(SegmentBar(int(s.bytes), int(s.used_bytes), waste, int(s.free_bytes), int(s.largest_free_bytes),
                               s.bytes / scale, _gradient(int(s.addr), int(s.bytes), inside,
                                                          int(s.largest_free_bytes))))
    return AllocatorPicture(
        title=moment.title, event_index=measured.event_index, reserved_bytes=measured.reserved_bytes,
        allocated_bytes=measured.allocated_bytes, internal_bytes=measured.internal_bytes,
        external_bytes=measured.external_bytes, largest_free_block_bytes=measured.largest_free_block_bytes,
        request_bytes=request, request_width=(request or 0) / scale, segments=moment.segment_count, bars=bars,
    )


def _gradient(start: int, size: int, blocks: pd.DataFrame, largest_free: int) -> str:
    """The segment's bytes left to right as hard colour stops: each block's requested bytes, its rounding waste,
    and the gaps (the first gap as large as the largest free block in its own colour)."""
    runs: list[tuple[str, int]] = []
    at, marked = start, False
    for k, (b_addr, allocated, requested) in enumerate(zip(blocks["addr"].to_numpy(dtype=np.int64),
                                           blocks["allocated_bytes"].to_numpy(dtype=np.int64),
                                           blocks["requested_bytes"].to_numpy(dtype=np.int64), strict=True)):
        if b_addr > at:
            marked = _gap(runs, int(b_addr - at), largest_free, marked)
        runs += [(USED_COLORS[k % 2], int(requested)), (WASTE_COLOR, int(allocated - requested))]
        at = max(at, int(b_addr + allocated))
    if start + size > at:
        _gap(runs, start + size - at, largest_free, marked)
    runs = [r for r in runs if r[1] > 0]
    if len(runs) > RUNS_EXACT:
        runs = _bucketed(runs, size)
    stops, edge = [], 0
    for color, n in runs:
        stops.append(f"{color} {edge / size:.2%} {(edge + n) / size:.2%}")
        edge += n
    return f"linear-gradient(to right, {', '.join(stops)})" if stops else FREE_COLOR


def _gap(runs: list[tuple[str, int]], n: int, largest_free: int, marked: bool) -> bool:
    largest = not marked and n == largest_free
    runs.append((LARGEST_FREE_COLOR if largest else FREE_COLOR, n))
    return marked or largest


def _bucketed(runs: list[tuple[str, int]], size: int) -> list[tuple[str, int]]:
    """RUN_BUCKETS equal parts of the segment, each in the colour that covers most of it (the numbers beside
    the bar stay exact; a segment of thousands of blocks is drawn at the width a screen can show)."""
    width = size / RUN_BUCKETS
    edges = np.cumsum([n for _, n in runs])
    out: list[tuple[str, int]] = []
    for k in range(RUN_BUCKETS):
        lo, hi = k * width, (k + 1) * width
        cover: dict[str, float] = {}
        first = int(np.searchsorted(edges, lo, side="right"))
        for i in range(first, len(runs)):
            begin = edges[i] - runs[i][1]
            if begin >= hi:
                break
            cover[runs[i][0]] = cover.get(runs[i][0], 0.0) + min(edges[i], hi) - max(begin, lo)
        color = max(cover, key=cover.__getitem__) if cover else FREE_COLOR
        part = int(round(hi)) - int(round(lo))
        if out and out[-1][0] == color:
            out[-1] = (color, out[-1][1] + part)
        else:
            out.append((color, part))
    return out


# --- the module tree at the peak as an icicle, each node with its categories ------------------------------------

@dataclass
class IcicleNode:
    label: str
    path: str
    bytes: int
    width: float                               # of its parent, 0..1
    categories: list[tuple[str, str, float]]   # (category, colour, share of the node), bottom of the stack first
    children: list[IcicleNode]


def module_icicle(d: DeviceAnalysis) -> list[IcicleNode]:
    """The module tree at the peak (d.module_tree, already folded) with the categories of each node's bytes."""
    live = d.peak.live
    if live.empty:
        return []
    sums = live.groupby([live["module"].astype(str), live["category"].astype(str)],
                        observed=True)["allocated_bytes"].sum()
    by_module: dict[str, dict[str, int]] = {}
    for (module, category), size in sums.items():
        by_module.setdefault(str(module), {})[str(category)] = int(size)
    everything = _total(by_module.values())
    return _icicle(d.module_tree, everything, by_module, 1)


def _total(parts: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for part in parts:
        for k, v in part.items():
            out[k] = out.get(k, 0) + v
    return out


def _under(path: str, by_module: dict[str, dict[str, int]]) -> dict[str, int]:
    return _total(v for m, v in by_module.items()
                  if m == path or m.startswith(path + ".") or m.startswith(path + MODULE_PATH_SEPARATOR))


def _icicle(nodes: list[ModuleNode], parent: dict[str, int], by_module: dict[str, dict[str, int]],
            depth: int) -> list[IcicleNode]:
    parent_bytes = max(sum(parent.values()), 1)
    named = {id(n): (by_module.get(n.path, {}) if n.label == OWN else _under(n.path, by_module))
             for n in nodes if not n.label.startswith("other (")}
    listed = _total(named.values())
    out = []
    for n in nodes:
        # an "other (N modules)" node holds what its parent holds beyond the nodes listed beside it
        cats = named.get(id(n)) or {k: v - listed.get(k, 0) for k, v in parent.items() if v > listed.get(k, 0)}
        total = max(sum(cats.values()), 1)
        shares = [(c, category_color(c), cats[c] / total) for c in sorted(cats, key=category_rank) if cats[c]]
        kids = _icicle(n.children, cats, by_module, depth + 1) if n.children and depth < ICICLE_DEPTH else []
        out.append(IcicleNode(visible(n.label), visible(n.path), n.bytes, n.bytes / parent_bytes, shares, kids))
    return out


