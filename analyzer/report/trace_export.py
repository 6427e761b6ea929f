"""`analyze TRACE --export-trace out.json`: the original Chrome trace plus counter tracks ("ph": "C") of
allocated bytes by category and by phase, so Perfetto UI and chrome://tracing show where memory went, on
the same time axis as the trace's own spans and kernels.

The original is streamed event by event (ijson), never held whole, by the reader's `ChromeTraceCopy` that the
command hands in (a reporter never reopens an input); the counters are thinned to at most MAX_POINTS a track (each
kept bucket keeps its highest point, so the peak is exact).
"""
from __future__ import annotations

import gzip
import io
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import orjson

from analyzer.core.timeline import downsample
from analyzer.result import Analysis

MAX_POINTS = 20_000
COUNTER_PID = 2**31 - 7  # a process id of its own, named below, so the tracks sit together
_TRACK_ORDER = ("category", "phase")


def counter_events(analysis: Analysis) -> list[dict[str, Any]]:
    """Metadata naming the counter process, then one counter event per kept point per track."""
    trace = analysis.trace
    out: list[dict[str, Any]] = [{"ph": "M", "name": "process_name", "pid": COUNTER_PID,
                                  "args": {"name": "analyzer: GPU memory"}}]
    for d in analysis.devices:
        events = trace.events[trace.events["device"] == d.device]
        times = events["t_us"].to_numpy(dtype=np.float64, na_value=np.nan)
        if not len(times) or np.isnan(times).all():
            continue
        timeline = trace.timeline[trace.timeline["device"] == d.device].iloc[1:]  # after each event
        kept = downsample(timeline.reset_index(drop=True), MAX_POINTS).index.to_numpy()
        label = trace.device_label(d.device)
        for column in _TRACK_ORDER:
            series = {name: values[1:][kept] for name, values in analysis.allocated_by(d.device, column).items()}
            for j, t in enumerate(times[kept]):
                if not np.isnan(t):
                    out.append({"ph": "C", "name": f"{label} allocated by {column}", "pid": COUNTER_PID, "tid": 0,
                                "ts": float(t) - trace.source_time_base_us,
                                "args": {name: int(values[j]) for name, values in series.items()}})
    return out


class Original(Protocol):
    """The analysed trace, streamed again (analyzer.ingest.chrome_copy.ChromeTraceCopy)."""

    def events(self) -> Iterable[Any]: ...

    def members(self) -> Iterable[tuple[str, Any]]: ...


def export_trace(analysis: Analysis, original: Original, out: Path) -> list[Path]:
    """Write the original trace (analyzer.ingest.chrome_copy.copy_of the analysed one) with the counter tracks
    added; `.gz` output is gzip-compressed."""
    counters = counter_events(analysis)
    with _open_output(out) as sink:
        sink.write(b'{"traceEvents": [')
        first = True
        for event in original.events():
            sink.write((b"" if first else b",\n") + orjson.dumps(event, default=_number))
            first = False
        for event in counters:
            sink.write((b"" if first else b",\n") + orjson.dumps(event))
            first = False
        sink.write(b"]")
        for key, value in original.members():
            sink.write(b",\n" + orjson.dumps(key) + b": " + orjson.dumps(value, default=_number))
        sink.write(b"}\n")
    return [out]


def _open_output(path: Path) -> io.BufferedIOBase:
    return gzip.open(path, "wb") if path.suffix == ".gz" else open(path, "wb")


def _number(value: Any) -> Any:
    """ijson gives Decimal for JSON numbers with a fraction: keep them as numbers."""
    return float(value)
