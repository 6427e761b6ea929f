"""Analysis: everything the reports show, computed once from a MemoryTrace (reporters only render it).

`Analysis.to_json()` is the stable contract behind `analyze --format json`: versioned by `SCHEMA`; later
versions add fields and never rename or drop these.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from analyzer.attribute import attribute
from analyzer.breakdown import TOP_MODULES, event_labels, labels_at, split, step_peaks
from analyzer.gc_pause import gc_paused
from analyzer.stacks import short_frame
from analyzer.timeline import Peak, find_peak
from analyzer.trace import MemoryTrace

SCHEMA = "analyzer/1"
CATEGORY_WORDS = {"activation": "activations", "temporary": "temporaries", "parameter": "parameters",
                  "gradient": "gradients", "optimizer_state": "optimizer states", "input": "inputs",
                  "other": "other allocations"}
PHASE_WORDS = {"forward": "forward", "backward": "backward", "optimizer": "optimizer step", "load": "model loading",
               "checkpoint_save": "checkpoint save", "compile": "torch.compile", "other": "between steps"}
TOP_ALLOCATIONS = 10


@dataclass
class OutOfMemory:
    """The last out-of-memory event of a device (the one that ended the run)."""

    requested_bytes: int
    device_free_bytes: int | None
    time_us: int | None
    event_index: int
    count: int                      # how many OOM entries the device recorded
    top_user_frame: str | None


@dataclass
class DeviceAnalysis:
    device: int
    peak: Peak
    reserved_peak_bytes: int
    end: dict[str, int]
    trace_entries: int
    history_truncated: bool
    oom: OutOfMemory | None
    capacity_bytes: int | None
    by_category: list[dict[str, Any]] = field(default_factory=list)   # at the peak, largest first
    by_phase: list[dict[str, Any]] = field(default_factory=list)
    by_module: list[dict[str, Any]] = field(default_factory=list)     # top 20, the rest folded
    peak_step: int | None = None
    peak_phase: str | None = None
    peak_module: str | None = None      # module of the allocation that made the peak
    steps: list[dict[str, Any]] = field(default_factory=list)
    findings: list[dict[str, Any]] = field(default_factory=list)
    remedies: list[dict[str, Any]] = field(default_factory=list)
    verdict: str | None = None          # one sentence: what ran out, where, why, what to try first
    theory: dict[str, Any] = field(default_factory=dict)          # measured model states vs 16Ψ
    fragmentation: dict[str, Any] | None = None                   # at the OOM, else at the reserved peak
    demand_bytes: int | None = None     # what the run needed: peak, or allocated + request at the OOM
    labels: pd.DataFrame | None = field(default=None, repr=False)  # step and phase after each event
    triage: dict[str, str] | None = None  # {verdict: outside_pytorch | leak | phase_spike | steady_state, reason}

    def headline(self) -> str:
        """'62% activations, forward of layers.11.mlp, step 1': what the peak is made of and where it is."""
        parts = []
        if self.by_category and self.by_category[0]["name"] != "unattributed":
            top = self.by_category[0]
            parts.append(f"{top['share']:.0%} {top['name'].replace('_', ' ')}")
        where = PHASE_WORDS.get(self.peak_phase) if self.peak_phase not in (None, "unattributed") else None
        module = short_frame(self.peak_module) if self.peak_module not in (None, "unattributed") else None
        if where and module:
            parts.append(f"{where} of {module}")
        elif where or module:
            parts.append(where or f"in {module}")
        if self.peak_step is not None:
            parts.append(f"step {self.peak_step}")
        return ", ".join(parts)

    def composition(self) -> str:
        """'activations are 71% of the peak': the largest attributed category, in words."""
        top = next((r for r in self.by_category if r["name"] != "unattributed"), None)
        if top is None:
            return ""
        return f"{CATEGORY_WORDS.get(top['name'], top['name'])} are {top['share']:.0%} of the peak"

    def top_allocations(self, trace: MemoryTrace, n: int = TOP_ALLOCATIONS) -> list[dict[str, Any]]:
        """The largest allocations live at the peak, with where they came from."""
        rows = []
        frames = trace.stacks["top_user_frame"]
        for r in self.peak.live.head(n).itertuples(index=False):
            where = None if pd.isna(r.stack_id) else frames.iat[int(r.stack_id)]
            rows.append({
                "allocated_bytes": int(r.allocated_bytes), "requested_bytes": int(r.requested_bytes),
                "address": int(r.addr), "t_alloc_us": None if pd.isna(r.t_alloc_us) else int(r.t_alloc_us),
                "origin": r.origin, "top_user_frame": where,
                "has_frames": not pd.isna(r.stack_id),
            })
        return rows


@dataclass
class Analysis:
    trace: MemoryTrace
    devices: list[DeviceAnalysis]
    warnings: list[str] = field(default_factory=list)  # the reader's warnings, then the analysis's

    def device(self, device: int) -> DeviceAnalysis:
        return next(d for d in self.devices if d.device == device)

    def to_json(self) -> dict[str, Any]:
        """The `analyzer/1` JSON contract (see the README)."""
        return {
            "schema": SCHEMA,
            "source": {"path": self.trace.source_path, "kind": self.trace.source_kind,
                       "torch_era": self.trace.torch_era, "has_history": self.trace.has_history},
            "allocator_settings": _jsonable(self.trace.allocator_settings),
            "warnings": list(self.warnings),
            "devices": [self._device_json(d) for d in self.devices],
        }

    def _device_json(self, d: DeviceAnalysis) -> dict[str, Any]:
        return {
            "device": d.device,
            "capacity_bytes": d.capacity_bytes,
            "peak": {
                "allocated_bytes": d.peak.allocated_bytes, "requested_bytes": d.peak.requested_bytes,
                "reserved_bytes": d.peak.reserved_bytes, "time_us": d.peak.time_us, "event_index": d.peak.event_index,
                "live_allocations": int(len(d.peak.live)),
                "top_allocations": d.top_allocations(self.trace),
                "by_category": {r["name"]: r["bytes"] for r in d.by_category},
                "by_phase": {r["name"]: r["bytes"] for r in d.by_phase},
                "by_module": {r["name"]: r["bytes"] for r in d.by_module},
                "step": d.peak_step, "phase": d.peak_phase, "module": d.peak_module,
                "summary": d.headline(),
            },
            "steps": d.steps,
            "reserved_peak_bytes": d.reserved_peak_bytes,
            "end": d.end,
            "trace_entries": d.trace_entries,
            "history_truncated": d.history_truncated,
            "oom": None if d.oom is None else {
                "requested_bytes": d.oom.requested_bytes, "device_free_bytes": d.oom.device_free_bytes,
                "time_us": d.oom.time_us, "event_index": d.oom.event_index, "count": d.oom.count,
                "top_user_frame": d.oom.top_user_frame,
            },
            "verdict": d.verdict,
            "triage": d.triage,
            "demand_bytes": d.demand_bytes,
            "fragmentation": d.fragmentation,
            "theory": d.theory,
            "findings": d.findings,
            "remedies": d.remedies,
        }

    def to_json_text(self) -> str:
        return json.dumps(self.to_json(), indent=2)


def combine_json(source_path: str, analyses: list[Analysis]) -> dict[str, Any]:
    """One analyzer/1 document for a set of ranks: every device carries its `rank`."""
    devices, warnings = [], []
    for a in analyses:
        doc = a.to_json()
        devices += [{**d, "rank": a.trace.rank} for d in doc["devices"]]
        warnings += [f"rank {a.trace.rank}: {w}" for w in doc["warnings"]]
    return {"schema": SCHEMA, "source": {"path": source_path, "kind": "ranks", "ranks": [a.trace.rank for a in analyses]},
            "allocator_settings": {}, "warnings": warnings, "devices": devices}


def _jsonable(value: Any) -> Any:
    """Allocator settings hold only plain values, but keys may be ints or tuples: make them JSON-safe."""
    return json.loads(json.dumps(value, default=str))


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


def active_devices(trace: MemoryTrace) -> list[int]:
    """Devices that hold any memory or history; idle entries of device_traces are left out."""
    used = {int(d) for table in (trace.segments, trace.events, trace.allocations) for d in table["device"].unique()}
    return [d for d in trace.device_ids if d in used]


def _device_warnings(d: DeviceAnalysis, timeline: pd.DataFrame) -> list[str]:
    """What a reader of the numbers must know about how complete and consistent they are."""
    out = []
    if d.history_truncated:
        out.append(f"device {d.device}: the history is truncated (the ring buffer wrapped or recording started late); "
                   f"{_start_bytes(timeline)} bytes were already allocated before the first recorded event and are "
                   "seeded from frees without allocs and from blocks alive at the end")
    over = timeline["allocated_bytes"] - timeline["reserved_bytes"]
    if len(over) and int(over.max()) > 0:
        out.append(f"device {d.device}: allocated bytes exceed reserved bytes by up to {int(over.max())} bytes; "
                   "the snapshot is internally inconsistent (edited or synthetic?), so reserved figures are unreliable")
    return out


def _start_bytes(timeline: pd.DataFrame) -> int:
    return int(timeline["allocated_bytes"].iloc[0]) if len(timeline) else 0


def analyze(source: str | Path | MemoryTrace, gpu_memory: int | None = None,
            world_size: int | None = None, device_usage: MemoryTrace | None = None) -> Analysis:
    """Analyse a file (any supported format) or an already loaded MemoryTrace: attribution, peaks, findings,
    remedies. `gpu_memory` (bytes) and `world_size` sharpen the remedies' estimates; `device_usage`, an Nsight
    export of the same run, shows the memory outside PyTorch."""
    if isinstance(source, MemoryTrace):
        trace = source
    else:
        from analyzer.ingest import load

        trace = load(source)
    with gc_paused():  # millions of live objects from the reader: see analyzer.gc_pause
        return _analyze(trace, gpu_memory, world_size, device_usage)


def _analyze(trace: MemoryTrace, gpu_memory: int | None, world_size: int | None,
             device_usage: MemoryTrace | None) -> Analysis:
    devices = []
    warnings = list(trace.warnings)
    attribute(trace)
    trace._timeline = None  # rebuilt with the per-category columns
    timeline = trace.timeline
    for device in active_devices(trace):
        info = trace.devices[device]
        tl = timeline[timeline["device"] == device]
        peak = find_peak(trace, device)
        labels = event_labels(trace, device)
        step, phase = labels_at(labels, peak.event_index)
        made = peak.live[peak.live["seq_alloc"] == peak.event_index]
        d = DeviceAnalysis(
            device=device, peak=peak, reserved_peak_bytes=int(tl["reserved_bytes"].max()),
            end=trace.end_state(device), trace_entries=info.trace_entries, history_truncated=info.history_truncated,
            oom=_oom(trace, device), capacity_bytes=info.capacity_bytes,
            by_category=split(peak.live, "category"), by_phase=split(peak.live, "phase"),
            by_module=split(peak.live, "module", TOP_MODULES), peak_step=step, peak_phase=phase,
            peak_module=str(made["module"].iloc[0]) if len(made) else None, steps=step_peaks(labels, tl), labels=labels,
        )
        devices.append(d)
        warnings.extend(_device_warnings(d, tl))
    if not devices:
        warnings.append("the input holds no allocations and no history on any device")
    elif not trace.has_history:
        warnings.append("no allocation history was recorded, so only the end state is known; record it with "
                        "torch.cuda.memory._record_memory_history(max_entries=100000) before the step, "
                        "then call torch.cuda.memory._dump_snapshot(path)")
    from analyzer.diagnose import diagnose

    return diagnose(Analysis(trace=trace, devices=devices, warnings=warnings), gpu_memory, world_size, device_usage)
