"""What a log's repeated memory lines show across time and ranks: growth step over step (a leak), one rank far
above the others (imbalance), each GPU's highest use in an nvidia-smi log, and each series of framework or
allocator memory lines at its highest (what a log without an OOM says about how close the run came)."""
from __future__ import annotations

import statistics
from collections import defaultdict
from itertools import pairwise
from typing import Any

from analyzer.core.log_records import (
    LOWEST_IS_WORST,
    READING_WORDS,
    GpuPeak,
    GpuProcess,
    LogFinding,
    MemoryHigh,
    Reading,
)
from analyzer.core.units import human_bytes

#: readings of one series needed before growth says anything
LEAK_MIN_READINGS = 5
#: growth from the first reading to the last of a series that is a leak (and it never goes down)
LEAK_MIN_GROWTH = 256 << 20
#: a rank whose peak is this many times the median rank's is out of balance
IMBALANCE_RATIO = 1.2

_SERIES_KEYS = ("allocated", "used")
#: readers whose readings have their own summary (gpu_peaks, gpu_processes)
_NVIDIA_SMI = ("nvidia_smi", "nvidia_smi_csv", "nvidia_smi_process")
_PEAK_KEYS = ("allocated_peak", "reserved_peak", "used", "allocated")


def _where(rank: int | None, device: int | None, label: str | None = None) -> str:
    """'rank 3, GPU 1, before forward': what a series' readings name of where they were taken."""
    return ", ".join(p for p in (f"rank {rank}" if rank is not None else "",
                                 f"GPU {device}" if device is not None else "", label or "") if p)


def _series(readings: list[Reading]) -> dict[tuple[Any, ...], list[tuple[int, int]]]:
    """(source, rank, device, label, key) -> [(line, bytes)] in order, for the keys that grow with a leak."""
    out: dict[tuple[Any, ...], list[tuple[int, int]]] = defaultdict(list)
    for r in readings:
        if r.source in ("nvidia_smi_process", "vllm", "sglang"):
            continue
        label = r.label if r.source != "nvidia_smi_csv" else None
        for key in _SERIES_KEYS:
            if key in r.bytes:
                out[(r.source, r.rank, r.device, label, key)].append((r.line, r.bytes[key]))
                break
    return out


def leaks(readings: list[Reading]) -> list[LogFinding]:
    """Series that never go down over at least LEAK_MIN_READINGS readings and grow by LEAK_MIN_GROWTH or more."""
    found: list[LogFinding] = []
    for (source, rank, device, label, key), points in _series(readings).items():
        values = [v for _, v in points]
        growth = values[-1] - values[0] if values else 0
        if len(values) >= LEAK_MIN_READINGS and growth >= LEAK_MIN_GROWTH and all(b >= a for a, b in pairwise(values)):
            where = _where(rank, device, label)
            found.append({"kind": "leak", "source": source, "rank": rank, "device": device, "label": label,
                          "readings": len(values), "first_line": points[0][0], "last_line": points[-1][0],
                          "first_bytes": values[0], "last_bytes": values[-1], "growth_bytes": growth,
                          "per_reading_bytes": growth // (len(values) - 1),
                          "summary": f"{key} memory grows in every one of {len(values)} {source} readings"
                                     f"{' (' + where + ')' if where else ''}: {human_bytes(values[0])} to {human_bytes(values[-1])}"})
    return found


def imbalance(readings: list[Reading]) -> LogFinding | None:
    """The rank whose highest reading is IMBALANCE_RATIO times the median rank's or more, if any."""
    peaks: dict[int, int] = {}
    for r in readings:
        if r.rank is None or r.source in ("nvidia_smi_process", "vllm", "sglang"):
            continue
        value = next((r.bytes[k] for k in _PEAK_KEYS if k in r.bytes), None)
        if value is not None:
            peaks[r.rank] = max(peaks.get(r.rank, 0), value)
    if len(peaks) < 2:
        return None
    median = statistics.median(peaks.values())
    rank, top = max(peaks.items(), key=lambda kv: kv[1])
    if median <= 0 or top < IMBALANCE_RATIO * median:
        return None
    return {"kind": "imbalance", "rank": rank, "peak_bytes": top, "median_bytes": int(median),
            "ranks": dict(sorted(peaks.items())),
            "summary": f"rank {rank} peaks at {human_bytes(top)}, {top / median:.2f}× the median rank ({human_bytes(median)})"}


def gpu_peaks(readings: list[Reading]) -> list[GpuPeak]:
    """Each GPU's highest nvidia-smi use (screen or CSV) and its capacity, in device order; a CSV queried without
    `index` gives one peak under device None (the highest any GPU it lists reached)."""
    peaks: dict[int | None, GpuPeak] = {}
    for r in readings:
        if r.source in ("nvidia_smi", "nvidia_smi_csv") and "used" in r.bytes:
            best = peaks.get(r.device)
            if best is None or r.bytes["used"] > best["used_bytes"]:
                peaks[r.device] = {"device": r.device, "used_bytes": r.bytes["used"], "total_bytes": r.bytes.get("total"),
                                   "line": r.line, "readings": (best["readings"] if best else 0) + 1}
            else:
                best["readings"] += 1
    return [peaks[d] for d in sorted(peaks, key=lambda d: (d is None, d or 0))]


def gpu_processes(readings: list[Reading]) -> list[GpuProcess]:
    """The processes nvidia-smi or list_gpu_processes() listed, the last reading of each (device, process)."""
    last: dict[tuple[int | None, str | None], GpuProcess] = {}
    for r in readings:
        if r.source == "nvidia_smi_process":
            last[(r.device, r.label)] = {"device": r.device, "process": r.label, "used_bytes": r.bytes["used"], "line": r.line}
    return sorted(last.values(), key=lambda p: (p["device"] is None, p["device"] or 0, -p["used_bytes"]))


def memory_highs(readings: list[Reading]) -> list[MemoryHigh]:
    """Each series of framework or allocator memory lines (one reader, rank and device) at its highest: what a log
    without an OOM says about how close the run came, in the order the series first appear."""
    groups: dict[tuple[str, int | None, int | None], list[Reading]] = {}
    for r in readings:
        if r.source not in _NVIDIA_SMI:
            groups.setdefault((r.source, r.rank, r.device), []).append(r)
    highs: list[MemoryHigh] = []
    for (source, rank, device), series in groups.items():
        worst: dict[str, int] = {}
        for key in READING_WORDS:
            values = [r.bytes[key] for r in series if key in r.bytes]
            if values:
                worst[key] = min(values) if key in LOWEST_IS_WORST else max(values)
        for key in ("allocated", "reserved"):   # a peak stands for its current value
            if f"{key}_peak" in worst:
                worst.pop(key, None)
        if not worst:
            continue
        where = _where(rank, device)
        count = f"{len(series)} reading{'s' if len(series) != 1 else ''}"
        counts = {k: max(r.counts.get(k, 0) for r in series) for k in {k for r in series for k in r.counts}}
        sizes = ", ".join(f"{READING_WORDS[k]} {human_bytes(v)}" for k, v in worst.items())
        retries = counts.get("alloc_retries", 0)
        flushed = (f"; {retries} allocation retr{'ies' if retries != 1 else 'y'} (the cache was emptied to make "
                   "room: a sign of fragmentation or of a step close to the limit)") if retries else ""
        highs.append({"source": source, "rank": rank, "device": device, "readings": len(series),
                      "first_line": series[0].line, "last_line": series[-1].line, "bytes": worst,
                      "counts": dict(sorted(counts.items())),
                      "summary": f"{source}{' ' + where if where else ''} ({count}): {sizes}{flushed}"})
    return highs
