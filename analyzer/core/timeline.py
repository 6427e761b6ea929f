"""Replay each device's allocator history into allocated, requested and reserved bytes over time.

Allocated bytes are block sizes (what `torch.cuda.memory_allocated()` shows); requested bytes are what the
callers asked for. Both are computed from the `allocations` table, so at every point they equal the sum of
the live allocations, and per-category or per-module splits of the same rows sum to them exactly. The
replay starts from the allocations alive before the first recorded event (frees with no alloc, blocks alive
at the end with no alloc): that is how a wrapped ring buffer or a late start is seeded. Reserved bytes are
anchored at the final segments and walked back through segment_alloc/free/map/unmap.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from analyzer.core.vocabulary import Category

_NO_TIME = np.iinfo(np.int64).min  # an event without a time, while the times are a plain int64 array
TIMELINE_COLUMNS = ["device", "t_us", "seq", "allocated_bytes", "requested_bytes", "reserved_bytes"]
_GROW = {"segment_alloc": 1, "segment_map": 1, "segment_free": -1, "segment_unmap": -1}


def _deltas(rows: pd.DataFrame, column: str, n_events: int) -> tuple[int, np.ndarray]:
    """(bytes alive before the first event, change at each event) for one size column of one device."""
    return _array_deltas(rows[column].to_numpy(dtype=np.int64), *_lifetimes(rows), n_events)


def _lifetimes(rows: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    return (rows["seq_alloc"].to_numpy(dtype=np.float64, na_value=np.nan),
            rows["seq_free"].to_numpy(dtype=np.float64, na_value=np.nan))


def _array_deltas(sizes: np.ndarray, seq_alloc: np.ndarray, seq_free: np.ndarray, n_events: int) -> tuple[int, np.ndarray]:
    delta = np.zeros(n_events, dtype=np.int64)
    allocated_in_trace = ~np.isnan(seq_alloc)
    freed_in_trace = ~np.isnan(seq_free)
    np.add.at(delta, seq_alloc[allocated_in_trace].astype(np.int64), sizes[allocated_in_trace])
    np.subtract.at(delta, seq_free[freed_in_trace].astype(np.int64), sizes[freed_in_trace])
    start = int(sizes[~allocated_in_trace].sum())
    return start, delta


def _reserved_deltas(trace, device: int, events: pd.DataFrame) -> tuple[int, np.ndarray]:
    """Reserved bytes before the first event and their change at each event: the final segments walked back."""
    segments = trace.segments
    end = int(segments.loc[(segments["device"] == device) & segments["alive_at_end"], "bytes"].sum())
    sign = events["action"].map(_GROW).fillna(0).to_numpy(dtype=np.int64)
    delta = sign * events["bytes"].to_numpy(dtype=np.int64)
    return end - int(delta.sum()), delta


def allocated_by(rows: pd.DataFrame, column: str, n_events: int) -> dict[str, np.ndarray]:
    """Allocated bytes per label of `column` (category, phase, module) before the first event and after each
    of the `n_events` events of one device: the labels' series sum to the allocated series."""
    codes, labels = pd.factorize(rows[column].to_numpy(dtype=object), use_na_sentinel=False)
    sizes = rows["allocated_bytes"].to_numpy(dtype=np.int64)
    seq_alloc, seq_free = _lifetimes(rows)
    out = {}
    for code, label in sorted(enumerate(labels), key=lambda pair: str(pair[1])):   # arrays, not a table per label
        mine = codes == code
        start, delta = _array_deltas(sizes[mine], seq_alloc[mine], seq_free[mine], n_events)
        out[str(label)] = np.concatenate([[start], start + np.cumsum(delta)]).astype(np.int64)
    return out


def allocated_by_category(rows: pd.DataFrame, n_events: int) -> dict[str, np.ndarray]:
    """`allocated_by` the category in force after each event: a row whose category holds only from an event
    on (`category_from_seq`) is a temporary until then."""
    out = allocated_by(rows, "category", n_events)
    settles = rows["category_from_seq"].to_numpy(dtype=np.float64, na_value=np.nan)
    pending = np.flatnonzero(~np.isnan(settles))
    if not len(pending):
        return out
    temporary = Category.TEMPORARY.value
    out.setdefault(temporary, np.zeros(n_events + 1, dtype=np.int64))
    sizes = rows["allocated_bytes"].to_numpy(dtype=np.int64)[pending]
    # series index k holds after event k - 1: a temporary after events born .. settles - 1
    starts = rows["seq_alloc"].to_numpy(dtype=np.float64, na_value=-1.0)[pending].astype(np.int64) + 1
    ends = np.minimum(settles[pending], n_events).astype(np.int64) + 1
    labels = rows["category"].to_numpy(dtype=object)[pending].astype(str)
    for label in np.unique(labels):
        mine = labels == label
        shift = np.zeros(n_events + 2, dtype=np.int64)
        np.add.at(shift, starts[mine], sizes[mine])
        np.subtract.at(shift, ends[mine], sizes[mine])
        moved = np.cumsum(shift)[:-1]
        out[temporary] += moved
        out[label] -= moved
    return out


def device_timeline(trace, device: int) -> pd.DataFrame:
    """One row before the first event (seq -1) and one after every event of `device`."""
    events = trace.events[trace.events["device"] == device]
    rows = trace.allocations[trace.allocations["device"] == device]
    n = len(events)
    alloc_start, alloc_delta = _deltas(rows, "allocated_bytes", n)
    req_start, req_delta = _deltas(rows, "requested_bytes", n)
    reserved_start, reserved_delta = _reserved_deltas(trace, device, events)
    times = events["t_us"].to_numpy(dtype=np.int64, na_value=_NO_TIME)
    times = np.concatenate([times[:1], times]) if n else np.full(1, _NO_TIME)  # the start row: the first time

    def series(start: int, delta: np.ndarray) -> np.ndarray:
        return np.concatenate([[start], start + np.cumsum(delta)]).astype(np.int64)

    by_category = {f"{c}_bytes": values for c, values in allocated_by_category(rows, n).items()}
    return pd.DataFrame({
        "device": np.full(n + 1, device, dtype=np.int64),
        "t_us": pd.arrays.IntegerArray(times, times == _NO_TIME),
        "seq": np.arange(-1, n, dtype=np.int64),
        "allocated_bytes": series(alloc_start, alloc_delta),
        "requested_bytes": series(req_start, req_delta),
        "reserved_bytes": series(reserved_start, reserved_delta),
        **by_category,  # allocated bytes per category: they sum to allocated_bytes at every row
    })


def build_timeline(trace) -> pd.DataFrame:
    """The `timeline` table for every device."""
    parts = [device_timeline(trace, d) for d in trace.device_ids]
    if not parts:
        return pd.DataFrame({c: pd.Series(dtype="Int64" if c == "t_us" else "int64") for c in TIMELINE_COLUMNS})
    timeline = pd.concat(parts, ignore_index=True)
    extra = [c for c in timeline.columns if c not in TIMELINE_COLUMNS]
    timeline[extra] = timeline[extra].fillna(0).astype(np.int64)  # a category absent on a device holds 0 bytes there
    return timeline


@dataclass
class Peak:
    """The moment of highest allocated bytes on one device."""

    device: int
    allocated_bytes: int
    requested_bytes: int
    reserved_bytes: int
    time_us: int | None
    event_index: int          # seq of the event after which the peak holds; -1: before the first event
    live: pd.DataFrame        # the allocations alive at that moment, largest first


def live_at(trace, device: int, seq: int) -> pd.DataFrame:
    """Allocations of `device` alive just after event `seq` (-1: before the first event)."""
    a = trace.allocations[trace.allocations["device"] == device]
    born = a["seq_alloc"].isna() | (a["seq_alloc"] <= seq)
    alive = a["seq_free"].isna() | (a["seq_free"] > seq)
    live = a[(born & alive).fillna(False).astype(bool)].sort_values("allocated_bytes", ascending=False, kind="stable")
    pending = (live["category_from_seq"] > seq).fillna(False).to_numpy(dtype=bool)
    if pending.any():   # the category in force then (allocated_by_category)
        live = live.copy()
        temporary = Category.TEMPORARY.value
        if temporary not in live["category"].cat.categories:
            live["category"] = live["category"].cat.add_categories([temporary])
        live.loc[pending, "category"] = temporary
    return live


def find_peak(trace, device: int) -> Peak:
    tl = trace.timeline
    tl = tl[tl["device"] == device]
    i = int(np.argmax(tl["allocated_bytes"].to_numpy()))
    row = tl.iloc[i]
    seq = int(row["seq"])
    return Peak(device=device, allocated_bytes=int(row["allocated_bytes"]), requested_bytes=int(row["requested_bytes"]),
                reserved_bytes=int(row["reserved_bytes"]), time_us=None if pd.isna(row["t_us"]) else int(row["t_us"]),
                event_index=seq, live=live_at(trace, device, seq))


def downsample(timeline: pd.DataFrame, max_points: int = 2000, column: str = "allocated_bytes") -> pd.DataFrame:
    """At most about `max_points` rows for drawing: each bucket keeps its lowest and highest row, so spikes
    survive, and the global peak is always kept exactly."""
    if len(timeline) <= max_points:
        return timeline
    values = timeline[column].to_numpy()
    buckets = np.arange(len(values)) * (max_points // 2) // len(values)
    frame = pd.DataFrame({"bucket": buckets, "value": values})
    grouped = frame.groupby("bucket")["value"]
    keep = np.union1d(grouped.idxmax().to_numpy(), grouped.idxmin().to_numpy())
    keep = np.union1d(keep, [0, len(values) - 1, int(np.argmax(values))])
    return timeline.iloc[keep]
