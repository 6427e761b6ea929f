"""A snapshot and an Nsight export of the same run, together: the device memory PyTorch's allocator cannot see.

The snapshot knows PyTorch's reserved segments; Nsight's CUDA_GPU_MEMORY_USAGE_EVENTS knows every cudaMalloc of
the process, PyTorch's segments and everyone else's (NCCL buffers, cuDNN/cuBLAS workspaces taken outside the
caching allocator, extensions). Both record the segment's virtual address, and two live allocations never
share one, so each Nsight allocation is matched to a PyTorch segment by device, address and size with
overlapping lifetimes. What stays unmatched is memory outside PyTorch. Matching by address instead of
subtracting two curves keeps the few microseconds between cudaMalloc returning and PyTorch recording it (and
any clock skew) from showing up as phantom spikes; the matched pairs also measure the offset between the two
clocks, which is then used to line up the series and the peak.

Neither source sees the CUDA context, loaded kernel images or untraced processes, and depending on the CUDA and
nsys versions Nsight's table may miss memory mapped with cuMemMap, which is how expandable segments reserve it. At an OOM the snapshot records
what cudaMemGetInfo said was free, so that remainder is reported too.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from analyzer.core.timeline import find_peak
from analyzer.core.trace import MemoryTrace
from analyzer.core.vocabulary import RECORD_MEMORY_HINT
from analyzer.errors import AnalyzerError

#: how far apart (µs) the two recorders' timestamps of one cudaMalloc may be and still match
DEFAULT_MAX_SKEW_US = 1_000_000
#: GPU activity rows listed in `activity_at_peak`
ACTIVITY_ROWS = 8


@dataclass
class _Step:
    """A step function of time: `initial` before the first change, then the value after each change."""

    times: np.ndarray
    values: np.ndarray
    initial: int

    def at(self, t: np.ndarray) -> np.ndarray:
        if not len(self.times):
            return np.full(len(t), self.initial, dtype=np.int64)
        index = np.searchsorted(self.times, t, side="right") - 1
        return np.where(index >= 0, self.values[np.maximum(index, 0)], self.initial).astype(np.int64)

    @classmethod
    def of_segments(cls, segments: pd.DataFrame, shift_us: int = 0) -> _Step:
        """Bytes of `segments` alive over time; a segment with no alloc time was alive from the start."""
        alloc = segments["t_alloc_us"].to_numpy(dtype="float64", na_value=np.nan)
        free = segments["t_free_us"].to_numpy(dtype="float64", na_value=np.nan)
        size = segments["bytes"].to_numpy(dtype=np.int64)
        times = np.concatenate([alloc[~np.isnan(alloc)], free[~np.isnan(free)]]).astype(np.int64) - shift_us
        deltas = np.concatenate([size[~np.isnan(alloc)], -size[~np.isnan(free)]])
        order = np.argsort(times, kind="stable")
        initial = int(size[np.isnan(alloc)].sum())
        return cls(times[order], initial + np.cumsum(deltas[order]), initial)

    @classmethod
    def of_timeline(cls, timeline: pd.DataFrame, column: str) -> _Step:
        """One device's rows of `MemoryTrace.timeline` (row seq -1 holds the value before the first event)."""
        rest = timeline[timeline["seq"] >= 0].sort_values(["t_us", "seq"], kind="stable")
        return cls(rest["t_us"].to_numpy(dtype=np.int64), rest[column].to_numpy(dtype=np.int64),
                   int(timeline.loc[timeline["seq"] == -1, column].iloc[0]))


def outside_pytorch(snapshot_trace: MemoryTrace, nsys_trace: MemoryTrace, device: int | None = None,
                    max_skew_us: int = DEFAULT_MAX_SKEW_US) -> dict[str, Any]:
    """Device memory allocated outside PyTorch's caching allocator, over time and at the peak (or OOM).

    `snapshot_trace` comes from a snapshot with timed history (torch >= 2.1, `_record_memory_history`), and
    `nsys_trace` from an export recorded with `--cuda-memory-usage=true`, of the same process. `device`
    defaults to the snapshot's OOM device, else the lowest device both hold. Returns:

    - `outside_bytes_at_peak`: bytes outside PyTorch when the snapshot OOMed, else at its allocated peak;
    - `outside_bytes_max`: the most bytes outside PyTorch at any time within the snapshot's history;
    - `series`: DataFrame (t_us, device_bytes, pytorch_reserved_bytes, outside_bytes) at every event of either
      source inside the snapshot's history, times on the snapshot's clock (epoch µs); device_bytes is what
      Nsight saw in use, so device_bytes - pytorch_reserved_bytes == outside_bytes whenever the two recorders
      agree on every PyTorch segment;
    - `outside_segments`: the unmatched Nsight allocations (device, addr, bytes, t_alloc_us, t_free_us);
    - `device`, `at` ("oom" or "peak"), `t_us`, `device_bytes_at_peak`, `pytorch_reserved_bytes_at_peak`,
      `clock_offset_us` (median Nsight-minus-snapshot time of matched segments: clock offset plus cudaMalloc
      latency), `unseen_bytes_at_oom` (capacity minus free minus what Nsight saw: context, kernel images,
      untraced processes; None without an OOM or capacity), `activity_at_peak` (the last GPU kernels/copies
      started by the peak; None when the export has no GPU activity), `notes` (what limits the figures).

    Raises AnalyzerError when the inputs cannot be combined (no memory events, no timed history, no shared
    device, or no PyTorch segment found in the Nsight export: not the same run).
    """
    _check_inputs(snapshot_trace, nsys_trace)
    device = _choose_device(snapshot_trace, nsys_trace, device)
    nsys_segments = nsys_trace.segments[nsys_trace.segments["device"] == device]
    torch_segments = snapshot_trace.segments[snapshot_trace.segments["device"] == device]
    matched, torch_matched, offset_us = _match_segments(nsys_segments, torch_segments, max_skew_us)
    if len(torch_segments) and not torch_matched.any():
        raise AnalyzerError(nsys_trace.source_path, f"none of the snapshot's {len(torch_segments)} segments on device "
                            f"{device} appears in the Nsight export, so the two are not recordings of the same process",
                            "Profile the run that wrote the snapshot: nsys profile --cuda-memory-usage=true ... "
                            "python train.py, with torch.cuda.memory._record_memory_history() in train.py.")
    timeline = snapshot_trace.timeline
    timeline = timeline[timeline["device"] == device]
    pytorch = _Step.of_timeline(timeline, "reserved_bytes")
    everything = _Step.of_segments(nsys_segments, offset_us)
    outside_segments = nsys_segments[~matched]
    outside = _Step.of_segments(outside_segments, offset_us)

    start, end = int(pytorch.times.min()), int(pytorch.times.max())
    times = np.union1d(pytorch.times, everything.times[(everything.times >= start) & (everything.times <= end)])
    series = pd.DataFrame({"t_us": times, "device_bytes": everything.at(times),
                           "pytorch_reserved_bytes": pytorch.at(times), "outside_bytes": outside.at(times)})
    at, t_peak, device_free = _peak_moment(snapshot_trace, device)
    point = np.array([t_peak])
    device_at_peak = int(everything.at(point)[0])
    capacity = _capacity(snapshot_trace, nsys_trace, device)
    return {
        "device": device, "at": at, "t_us": t_peak,
        "outside_bytes_at_peak": int(outside.at(point)[0]),
        "outside_bytes_max": int(series["outside_bytes"].max()),
        "device_bytes_at_peak": device_at_peak,
        "pytorch_reserved_bytes_at_peak": int(pytorch.at(point)[0]),
        "unseen_bytes_at_oom": None if device_free is None or capacity is None else capacity - device_free - device_at_peak,
        "clock_offset_us": offset_us,
        "series": series,
        "outside_segments": _on_snapshot_clock(outside_segments, offset_us),
        "activity_at_peak": _activity_before(nsys_trace.kernels, device, t_peak, offset_us),
        "notes": _notes(torch_segments, torch_matched, start, end),
    }


def _check_inputs(snapshot_trace: MemoryTrace, nsys_trace: MemoryTrace) -> None:
    if nsys_trace.events.empty:
        raise AnalyzerError(nsys_trace.source_path, "the Nsight export holds no device memory events "
                            "(CUDA_GPU_MEMORY_USAGE_EVENTS)", RECORD_MEMORY_HINT + ".")
    times = snapshot_trace.events["t_us"]
    if times.empty or times.isna().any():
        raise AnalyzerError(snapshot_trace.source_path, "the snapshot has no timed allocator history to line up with "
                            "the Nsight export", "Record it with torch >= 2.1: torch.cuda.memory._record_memory_history() "
                            "before the run, torch.cuda.memory._dump_snapshot(path) after it.")


def _choose_device(snapshot_trace: MemoryTrace, nsys_trace: MemoryTrace, device: int | None) -> int:
    common = sorted(set(snapshot_trace.events["device"]) & set(nsys_trace.events["device"]))
    if device is not None and device not in common:
        raise AnalyzerError(nsys_trace.source_path, f"device {device} is not recorded by both inputs (both hold: "
                            f"{common or 'none'})", "Pick one of those devices.")
    if device is not None:
        return device
    if not common:
        raise AnalyzerError(nsys_trace.source_path, "the snapshot and the Nsight export share no device",
                            "Pass a snapshot and an export of the same process.")
    oom_devices = [int(d) for d in snapshot_trace.ooms["device"] if d in common]
    return oom_devices[-1] if oom_devices else int(common[0])


def _match_segments(nsys_segments: pd.DataFrame, torch_segments: pd.DataFrame,
                    max_skew_us: int) -> tuple[np.ndarray, np.ndarray, int]:
    """(Nsight rows that are PyTorch segments, snapshot rows found in Nsight, median clock offset in µs)."""
    candidates: dict[tuple[int, int], list[int]] = defaultdict(list)
    for i, (addr, size) in enumerate(zip(torch_segments["addr"], torch_segments["bytes"], strict=True)):
        candidates[(int(addr), int(size))].append(i)
    lifetimes = [_interval(a, f) for a, f in zip(torch_segments["t_alloc_us"], torch_segments["t_free_us"], strict=True)]
    matched = np.zeros(len(nsys_segments), dtype=bool)
    torch_matched = np.zeros(len(torch_segments), dtype=bool)
    offsets = []
    for i, (addr, size, t_alloc, t_free) in enumerate(zip(nsys_segments["addr"], nsys_segments["bytes"],
                                                          nsys_segments["t_alloc_us"], nsys_segments["t_free_us"], strict=True)):
        start, end = _interval(t_alloc, t_free)
        overlapping = [j for j in candidates.get((int(addr), int(size)), ()) if not torch_matched[j]
                       and start - max_skew_us <= lifetimes[j][1] and lifetimes[j][0] <= end + max_skew_us]
        if not overlapping:
            continue
        j = min(overlapping, key=lambda k: _distance(lifetimes[k][0], start))
        matched[i] = torch_matched[j] = True
        if np.isfinite(start) and np.isfinite(lifetimes[j][0]):
            offsets.append(start - lifetimes[j][0])
    return matched, torch_matched, int(np.median(offsets)) if offsets else 0


def _distance(a: float, b: float) -> float:
    """How far apart two alloc times are; unknown times are equally far from everything."""
    return abs(a - b) if np.isfinite(a) and np.isfinite(b) else np.inf


def _interval(t_alloc: Any, t_free: Any) -> tuple[float, float]:
    """A lifetime with unknown ends open to the past or the future."""
    return (-np.inf if pd.isna(t_alloc) else float(t_alloc), np.inf if pd.isna(t_free) else float(t_free))


def _peak_moment(snapshot_trace: MemoryTrace, device: int) -> tuple[str, int, int | None]:
    """("oom", time, device free bytes) of the device's last OOM, else ("peak", time of the allocated peak, None)."""
    ooms = snapshot_trace.ooms[(snapshot_trace.ooms["device"] == device) & snapshot_trace.ooms["t_us"].notna()]
    if len(ooms):
        last = ooms.iloc[-1]
        free = last["device_free_bytes"]
        return "oom", int(last["t_us"]), None if pd.isna(free) else int(free)
    peak = find_peak(snapshot_trace, device)
    assert peak.time_us is not None  # _check_inputs: the snapshot's events are all timed, and `device` has some
    return "peak", peak.time_us, None


def _capacity(snapshot_trace: MemoryTrace, nsys_trace: MemoryTrace, device: int) -> int | None:
    for trace in (nsys_trace, snapshot_trace):
        info = trace.devices.get(device)
        if info is not None and info.capacity_bytes is not None:
            return info.capacity_bytes
    return None


def _on_snapshot_clock(segments: pd.DataFrame, offset_us: int) -> pd.DataFrame:
    out = segments[["device", "addr", "bytes", "t_alloc_us", "t_free_us"]].reset_index(drop=True)
    return out.assign(t_alloc_us=out["t_alloc_us"] - offset_us, t_free_us=out["t_free_us"] - offset_us)


def _activity_before(kernels: pd.DataFrame | None, device: int, t_us: int, offset_us: int) -> pd.DataFrame | None:
    """The last GPU activities of `device` that started by `t_us` (snapshot clock), newest last."""
    if kernels is None:
        return None
    mine = kernels[(kernels["device"] == device) & (kernels["start_us"] - offset_us <= t_us)]
    recent = mine.sort_values("start_us", kind="stable").tail(ACTIVITY_ROWS).reset_index(drop=True)
    return recent.assign(start_us=recent["start_us"] - offset_us, end_us=recent["end_us"] - offset_us)


def _notes(torch_segments: pd.DataFrame, torch_matched: np.ndarray, start: int, end: int) -> list[str]:
    """PyTorch segments of the snapshot's window that Nsight did not see make device_bytes an undercount."""
    alloc = torch_segments["t_alloc_us"].astype("Float64").fillna(-np.inf).to_numpy(dtype="float64")
    free = torch_segments["t_free_us"].astype("Float64").fillna(np.inf).to_numpy(dtype="float64")
    unseen = ~torch_matched & (alloc <= end) & (free >= start)
    if not unseen.any():
        return []
    expandable = bool(torch_segments.loc[unseen, "expandable"].any())
    return [f"{int(unseen.sum())} PyTorch segments ({int(torch_segments.loc[unseen, 'bytes'].sum())} bytes) are not in "
            "the Nsight export, so device_bytes undercounts the device usage"
            + (" (expandable segments are mapped with cuMemMap, which CUDA_GPU_MEMORY_USAGE_EVENTS may not show)"
               if expandable else " (did the capture start after they were allocated?)")]
