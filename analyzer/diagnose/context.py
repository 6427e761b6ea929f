"""What every detector and remedy needs to know about one device, computed once and shared between them."""
from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, TypeVar, cast

import pandas as pd

from analyzer.core.timeline import live_at
from analyzer.core.trace import MemoryTrace
from analyzer.diagnose.step_levels import StepLevel, step_levels
from analyzer.result import DeviceMeasures

T = TypeVar("T")


@dataclass
class DeviceContext:
    trace: MemoryTrace
    d: DeviceMeasures
    timeline: pd.DataFrame            # this device's rows
    labels: pd.DataFrame              # step and phase after each event
    capacity_bytes: int | None        # usable device memory, if known
    capacity_source: str              # where that number came from
    world_size: int | None = None     # GPUs the job could shard over (for ZeRO / TP / PP estimates)
    device_usage: MemoryTrace | None = None  # a second recording of the run that sees the device (Nsight)
    scatter_excess: int = 0           # batch memory above an even split of nn.DataParallel's scatter (imbalance)
    _live: dict[int, pd.DataFrame] = field(default_factory=dict, repr=False)
    _measured: dict[Hashable, Any] = field(default_factory=dict, repr=False)

    @property
    def device(self) -> int:
        return self.d.device

    @property
    def allocations(self) -> pd.DataFrame:
        return self.trace.allocations[self.trace.allocations["device"] == self.device]

    @cached_property
    def step_levels(self) -> list[StepLevel]:
        """Memory at the start of every step (leak, reserved growth and the triage read it)."""
        return step_levels(self.allocations, self.timeline)

    def live_at(self, seq: int) -> pd.DataFrame:
        """Allocations alive just after event `seq`, largest first; computed once per moment (the OOM, the
        reserved peak, a phase peak are each asked for by several detectors)."""
        if seq == self.d.peak.event_index:
            return self.d.peak.live
        if seq not in self._live:
            self._live[seq] = live_at(self.trace, self.device, seq)
        return self._live[seq]

    def memo(self, key: Hashable, compute: Callable[[], T]) -> T:
        """A measurement several detectors (or the remedies) read, computed once by whichever asks first: each
        computes it from the trace alone, so the detectors' order never matters."""
        if key not in self._measured:
            self._measured[key] = compute()
        return cast(T, self._measured[key])

    def at(self, seq: int) -> pd.Series:
        """The timeline row just after event `seq`."""
        rows = self.timeline[self.timeline["seq"] == seq]
        return rows.iloc[0] if len(rows) else self.timeline.iloc[-1]

    def category_bytes(self, category: str) -> int:
        return sum(r["bytes"] for r in self.d.by_category if r["name"] == category)

    def expandable_segments(self) -> bool | None:
        value = self.trace.allocator_settings.get("expandable_segments") if self.trace.allocator_settings else None
        return None if value is None else bool(value)


def make_context(trace: MemoryTrace, d: DeviceMeasures, gpu_memory: int | None, world_size: int | None,
                 device_usage: MemoryTrace | None = None, scatter_excess: int = 0) -> DeviceContext:
    timeline = trace.timeline[trace.timeline["device"] == d.device]
    capacity, source = _capacity(trace, d, gpu_memory)
    return DeviceContext(trace=trace, d=d, timeline=timeline, labels=d.labels, capacity_bytes=capacity,
                         capacity_source=source, world_size=world_size, device_usage=device_usage,
                         scatter_excess=scatter_excess)


def _capacity(trace: MemoryTrace, d: DeviceMeasures, gpu_memory: int | None) -> tuple[int | None, str]:
    """--gpu-memory, else what the input records, else what the OOM shows PyTorch could have had."""
    if gpu_memory:
        return gpu_memory, "--gpu-memory"
    if d.recorded_capacity_bytes:
        return d.recorded_capacity_bytes, "recorded device memory"
    if d.oom is not None and d.oom.device_free_bytes is not None:
        reserved = int(trace.timeline.loc[(trace.timeline["device"] == d.device)
                                          & (trace.timeline["seq"] == d.oom.event_index), "reserved_bytes"].iloc[0])
        return reserved + d.oom.device_free_bytes, "reserved + free at the OOM (a lower bound of the device's memory)"
    return None, "unknown (pass --gpu-memory)"
