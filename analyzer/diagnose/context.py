"""What every detector and remedy needs to know about one device, computed once."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from analyzer.analysis import DeviceAnalysis
from analyzer.breakdown import event_labels
from analyzer.trace import MemoryTrace


@dataclass
class DeviceContext:
    trace: MemoryTrace
    d: DeviceAnalysis
    timeline: pd.DataFrame            # this device's rows
    labels: pd.DataFrame              # step and phase after each event
    capacity_bytes: int | None        # usable device memory, if known
    capacity_source: str              # where that number came from
    world_size: int | None = None     # GPUs the job could shard over (for ZeRO / TP / PP estimates)
    extras: dict[str, Any] = field(default_factory=dict)

    @property
    def device(self) -> int:
        return self.d.device

    @property
    def allocations(self) -> pd.DataFrame:
        return self.trace.allocations[self.trace.allocations["device"] == self.device]

    def at(self, seq: int) -> pd.Series:
        """The timeline row just after event `seq`."""
        rows = self.timeline[self.timeline["seq"] == seq]
        return rows.iloc[0] if len(rows) else self.timeline.iloc[-1]

    def category_bytes(self, category: str) -> int:
        return sum(r["bytes"] for r in self.d.by_category if r["name"] == category)

    def expandable_segments(self) -> bool | None:
        value = self.trace.allocator_settings.get("expandable_segments") if self.trace.allocator_settings else None
        return None if value is None else bool(value)


def make_context(trace: MemoryTrace, d: DeviceAnalysis, gpu_memory: int | None, world_size: int | None) -> DeviceContext:
    timeline = trace.timeline[trace.timeline["device"] == d.device]
    capacity, source = _capacity(trace, d, gpu_memory)
    return DeviceContext(trace=trace, d=d, timeline=timeline, labels=d.labels if d.labels is not None else event_labels(trace, d.device),
                         capacity_bytes=capacity, capacity_source=source, world_size=world_size)


def _capacity(trace: MemoryTrace, d: DeviceAnalysis, gpu_memory: int | None) -> tuple[int | None, str]:
    """--gpu-memory, else what the input records, else what the OOM shows PyTorch could have had."""
    if gpu_memory:
        return gpu_memory, "--gpu-memory"
    if d.capacity_bytes:
        return d.capacity_bytes, "recorded device memory"
    if d.oom is not None and d.oom.device_free_bytes is not None:
        reserved = int(trace.timeline.loc[(trace.timeline["device"] == d.device)
                                          & (trace.timeline["seq"] == d.oom.event_index), "reserved_bytes"].iloc[0])
        return reserved + d.oom.device_free_bytes, "reserved + free at the OOM (a lower bound of the device's memory)"
    return None, "unknown (pass --gpu-memory)"
