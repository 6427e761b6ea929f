"""The one run of an analysis: read, attribute, measure, diagnose; every stage a function of the one before.

    path ─► ingest.load ─► MemoryTrace ─► attribute ─► measure (peak, breakdowns, steps) ─► diagnose ─► Analysis

A set of ranks (a directory or .tar.gz of per-rank traces, a `MultiRankTrace`) is analysed rank by rank into a
`RankSetAnalysis`.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import overload

import pandas as pd

from analyzer.attribute import attribute
from analyzer.core.breakdown import TOP_MODULES, by_site, event_labels, labels_at, split, step_peaks
from analyzer.core.gc_pause import gc_paused
from analyzer.core.module_tree import module_tree
from analyzer.core.timeline import find_peak
from analyzer.core.trace import PROFILED_LATE, MemoryTrace, MultiRankTrace
from analyzer.core.units import human_bytes
from analyzer.core.vocabulary import RECORD_HISTORY
from analyzer.diagnose import diagnose
from analyzer.diagnose.context import make_context
from analyzer.diagnose.fragmentation import segments_pictured
from analyzer.diagnose.imbalance import find_imbalance, scatter_excess, summarise
from analyzer.diagnose.thresholds import Thresholds
from analyzer.ingest import load
from analyzer.result import (
    TOP_ALLOCATIONS,
    Analysis,
    DeviceAnalysis,
    DeviceMeasures,
    EndState,
    OutOfMemory,
    PeakAllocation,
    RankSetAnalysis,
)


@overload
def analyze(source: MemoryTrace, gpu_memory: int | None = None, world_size: int | None = None,
            device_usage: MemoryTrace | None = None, *, source_roots: Sequence[str | Path] = (),
            thresholds: Thresholds = Thresholds()) -> Analysis: ...


@overload
def analyze(source: MultiRankTrace, gpu_memory: int | None = None, world_size: int | None = None,
            device_usage: MemoryTrace | None = None, *, source_roots: Sequence[str | Path] = (),
            thresholds: Thresholds = Thresholds()) -> RankSetAnalysis: ...


@overload
def analyze(source: str | Path, gpu_memory: int | None = None, world_size: int | None = None,
            device_usage: MemoryTrace | None = None, *, source_roots: Sequence[str | Path] = (),
            thresholds: Thresholds = Thresholds()) -> Analysis | RankSetAnalysis: ...


def analyze(source: str | Path | MemoryTrace | MultiRankTrace, gpu_memory: int | None = None,
            world_size: int | None = None, device_usage: MemoryTrace | None = None, *,
            source_roots: Sequence[str | Path] = (), thresholds: Thresholds = Thresholds()) -> Analysis | RankSetAnalysis:
    """Analyse a file (any supported format, a set of ranks included) or an already loaded trace: attribution,
    peaks, findings, remedies. `gpu_memory` (bytes) and `world_size` sharpen the remedies' estimates;
    `device_usage`, an Nsight export of the same run, shows the memory outside PyTorch; `source_roots`, local
    checkouts of the code the recording ran, let module class names be read from frames recorded elsewhere;
    `thresholds` (analyzer.diagnose.thresholds.Thresholds) tunes what the detectors call a finding."""
    loaded = source if isinstance(source, (MemoryTrace, MultiRankTrace)) else load(source)
    with gc_paused():  # millions of live objects from the reader: see analyzer.core.gc_pause
        if isinstance(loaded, MultiRankTrace):
            return RankSetAnalysis(source_path=loaded.source_path, warnings=list(loaded.warnings),
                                   ranks=[analyze_trace(t, gpu_memory, world_size, device_usage, source_roots=source_roots,
                                                        thresholds=thresholds) for t in loaded.traces])
        return analyze_trace(loaded, gpu_memory, world_size, device_usage, source_roots=source_roots,
                             thresholds=thresholds)


def analyze_trace(trace: MemoryTrace, gpu_memory: int | None = None, world_size: int | None = None,
                  device_usage: MemoryTrace | None = None, *, source_roots: Sequence[str | Path] = (),
                  thresholds: Thresholds = Thresholds()) -> Analysis:
    """One recording: attributed (a new trace; the given one is left as it was), measured and diagnosed."""
    trace = attribute(trace, source_roots=source_roots, frozen_lump_share=thresholds.frozen_lump_share)
    warnings = list(trace.warnings)
    measured = [measure(trace, device) for device in active_devices(trace)]
    # the GPUs compared first: a device nn.DataParallel's uneven scatter made heavy is told so in its own remedies
    peaks = [summarise(trace.device_label(m.device), m) for m in measured if m.device >= 0]
    imbalance = find_imbalance(peaks, **thresholds.imbalance())
    excess = scatter_excess(imbalance, peaks)
    devices = []
    for measures in measured:
        device = measures.device
        warnings.extend(_device_warnings(measures, trace.timeline[trace.timeline["device"] == device],
                                         trace))
        ctx = make_context(trace, measures, gpu_memory or _recorded_capacity(device_usage, device), world_size,
                           device_usage, excess.get(trace.device_label(device), 0))
        devices.append(DeviceAnalysis(**vars(measures), diagnosis=diagnose(ctx, thresholds),
                                      top_allocations=top_allocations(trace, measures),
                                      segments_pictured=segments_pictured(ctx)))
    if not devices:
        warnings.append("the input holds no allocations and no history on any device")
    elif not trace.has_history:
        warnings.append("no allocation history was recorded, so only the end state is known; record it with "
                        f"{RECORD_HISTORY} before the step, "
                        "then call torch.cuda.memory._dump_snapshot(path)")
    return Analysis(trace=trace, devices=devices, warnings=warnings, imbalance=imbalance)


def measure(trace: MemoryTrace, device: int) -> DeviceMeasures:
    """The peak of one device, what it is made of, where it is, and the peak of every step."""
    info = trace.devices[device]
    tl = trace.timeline[trace.timeline["device"] == device]
    peak = find_peak(trace, device)
    labels = event_labels(trace, device)
    step, phase = labels_at(labels, peak.event_index)
    made = peak.live[peak.live["seq_alloc"] == peak.event_index]
    return DeviceMeasures(
        device=device, peak=peak, reserved_peak_bytes=int(tl["reserved_bytes"].max()),
        end=end_state(trace, device, tl, info.reserved_recorded), trace_entries=info.trace_entries, history_truncated=info.history_truncated,
        oom=_oom(trace, device), recorded_capacity_bytes=info.capacity_bytes,
        by_category=split(peak.live, "category"), by_phase=split(peak.live, "phase"),
        by_module=split(peak.live, "module", TOP_MODULES), by_site=by_site(trace, peak.live),
        module_tree=module_tree(peak.live) if len(peak.live) else [], peak_step=step, peak_phase=phase,
        peak_module=str(made["module"].iloc[0]) if len(made) else None, steps=step_peaks(labels, tl), labels=labels,
        reserved_recorded=info.reserved_recorded,
    )


def end_state(trace: MemoryTrace, device: int, timeline: pd.DataFrame, reserved_recorded: bool) -> EndState:
    """The state at the end of the recording: the allocator's final blocks where the input records them (a
    snapshot); else the timeline's last point (the trace's last running totals), with what it cannot hold
    (blocks; reserved bytes it did not record) None. The JSON and every report read this one dict."""
    if trace.has_segments or timeline.empty:
        blocks = trace.end_state(device)
        end: EndState = {"allocated_bytes": blocks["allocated_bytes"], "requested_bytes": blocks["requested_bytes"],
                         "reserved_bytes": blocks["reserved_bytes"], "inactive_bytes": blocks["inactive_bytes"],
                         "largest_free_block_bytes": blocks["largest_free_block_bytes"]}
        return end if trace.has_segments else {**end, "inactive_bytes": None, "largest_free_block_bytes": None}
    last = timeline.iloc[-1]
    allocated = int(last["allocated_bytes"])
    held = int(last["reserved_bytes"]) if reserved_recorded else None
    return {"allocated_bytes": allocated, "requested_bytes": int(last["requested_bytes"]), "reserved_bytes": held,
            "inactive_bytes": None if held is None else held - allocated, "largest_free_block_bytes": None}


def top_allocations(trace: MemoryTrace, d: DeviceMeasures, n: int = TOP_ALLOCATIONS) -> list[PeakAllocation]:
    """The largest allocations live at the peak, with where they came from."""
    rows: list[PeakAllocation] = []
    frames, ops = trace.stacks["top_user_frame"], trace.stacks["op"]
    for r in d.peak.live.head(n).itertuples(index=False):
        framed = not pd.isna(r.stack_id)
        rows.append({
            "allocated_bytes": int(r.allocated_bytes), "requested_bytes": int(r.requested_bytes),
            "address": int(r.addr), "t_alloc_us": None if pd.isna(r.t_alloc_us) else int(r.t_alloc_us),
            "origin": r.origin, "top_user_frame": frames.iat[int(r.stack_id)] if framed else None,
            "op": ops.iat[int(r.stack_id)] if framed else None,
            "has_frames": framed,
        })
    return rows


def active_devices(trace: MemoryTrace) -> list[int]:
    """Devices that hold any memory or history; idle entries of device_traces are left out."""
    used = {int(d) for table in (trace.segments, trace.events, trace.allocations) for d in table["device"].unique()}
    return [d for d in trace.device_ids if d in used]


def _oom(trace: MemoryTrace, device: int) -> OutOfMemory | None:
    ooms = trace.ooms[trace.ooms["device"] == device]
    if ooms.empty:
        return None
    last = ooms.iloc[-1]
    stack = last["stack_id"]
    return OutOfMemory(
        requested_bytes=int(last["requested_bytes"]),
        device_free_bytes=None if pd.isna(last["device_free_bytes"]) else int(last["device_free_bytes"]),
        time_us=None if pd.isna(last["t_us"]) else int(last["t_us"]),
        event_index=int(last["seq"]), count=len(ooms),
        top_user_frame=None if pd.isna(stack) else trace.stacks["top_user_frame"].iat[int(stack)],
    )


def _recorded_capacity(device_usage: MemoryTrace | None, device: int) -> int | None:
    info = device_usage.devices.get(device) if device_usage is not None else None
    return info.capacity_bytes if info is not None else None


def _device_warnings(d: DeviceMeasures, timeline: pd.DataFrame, trace: MemoryTrace) -> list[str]:
    """What a reader of the numbers must know about how complete and consistent they are."""
    out = []
    if d.history_truncated:
        start = human_bytes(int(timeline["allocated_bytes"].iloc[0]) if len(timeline) else 0)
        why, how = trace.alive_before or PROFILED_LATE
        out.append(f"device {d.device}: {start} were already allocated before the first recorded event ({why}); {how}")
    over = timeline["allocated_bytes"] - timeline["reserved_bytes"]
    if len(over) and int(over.max()) > 0:
        out.append(f"device {d.device}: allocated bytes exceed reserved bytes by up to {human_bytes(int(over.max()))}; "
                   "the snapshot is internally inconsistent (edited or synthetic?), so reserved figures are unreliable")
    return out
