"""The view-model every reporter renders: what a report says, as plain values, built once from an Analysis.

Reporters (HTML, PDF, Markdown, terminal) only lay these values out and escape them for their medium; the
choices of what to show (how many allocations, which device leads the verdict, how a finding's evidence reads)
are made here once, so the formats agree and tests check the content on this data rather than on markup.
Strings from the input file are kept raw here: escaping is the job of each renderer, for its own medium.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import pandas as pd

from analyzer import __version__
from analyzer.core.breakdown import SplitRow, StepPeak
from analyzer.core.module_tree import ModuleNode, module_in_sentence
from analyzer.core.stacks import format_frame, is_user_frame
from analyzer.core.timeline import downsample
from analyzer.core.trace import MemoryTrace
from analyzer.core.units import human_bytes, relative_seconds
from analyzer.core.vocabulary import UNATTRIBUTED, category_color, category_rank, phase_color
from analyzer.report.page import words
from analyzer.report.shown import shown
from analyzer.result import (
    Analysis,
    Details,
    DeviceAnalysis,
    EndState,
    Finding,
    ImbalanceFinding,
    ListedRemedy,
    Plan,
    Theory,
)

LIVE_SHOWN = 25          # allocations live at the peak listed with their stacks
FRAMES_SHOWN = 40        # frames of one stack, innermost first
SEGMENTS_SHOWN = 20
STEPS_SHOWN = 50
DETAIL_ITEMS = 8         # items of a list shown in a finding's details
CHART_POINTS = (150, 1000, 2400)  # timeline rows drawn per device: at least, at most, all devices together
BAND_MIN_WIDTH = 0.004   # phase runs narrower than this share of the chart join the run before them
SEVERITY_ORDER = {"critical": 0, "warning": 1, "info": 2}
MODULE_COLOR = "#4c72b0"


@dataclass
class Share:
    name: str
    label: str           # how the name reads: `train.py:12 forward` for a long path, spaces for underscores
    bytes: int
    share: float
    color: str


@dataclass
class Frame:
    text: str            # "file:line function"
    user: bool           # the user's code (not torch, C++ or the interpreter)


@dataclass
class LiveAllocation:
    allocated_bytes: int
    requested_bytes: int
    category: str
    phase: str
    module: str
    where: str | None    # innermost user frame
    op: str | None       # the ATen op the C++ frames name (shown where no user frame was recorded)
    frames: list[Frame]
    frames_left_out: int
    allocated_at: str    # relative time, or why it is unknown


@dataclass
class Site:
    """Allocations live at the peak grouped by the user line that made them."""

    where: str | None
    count: int
    bytes: int
    share: float


@dataclass
class Band:
    start: int           # allocator event index
    end: int
    phase: str
    color: str


@dataclass
class Chart:
    title: str
    points: pd.DataFrame                 # seq, allocated_bytes, reserved_bytes (where recorded), one column a category
    categories: list[tuple[str, str, str]]  # (name, column, color), bottom of the stack first
    bands: list[Band]
    peak_seq: int
    peak_bytes: int
    oom_seq: int | None
    capacity_bytes: int | None


@dataclass
class Detail:
    name: str
    text: str


@dataclass
class EvidenceAllocation:
    bytes: int
    where: str | None
    op: str | None
    module: str | None
    category: str | None


@dataclass
class FindingView:
    kind: str
    severity: str
    bytes: int | None
    summary: str
    when: str | None
    events: str | None
    allocations: list[EvidenceAllocation]
    details: list[Detail]


@dataclass
class RemedyView:
    id: str
    rank: int | None
    title: str
    saved_bytes: int | None
    new_peak_bytes: int | None
    fits: bool | None
    confidence: str | None
    try_first: bool
    how: str | None
    cost: str | None
    note: str | None = None              # why it saves what a cheaper one saves, when it does
    plan_step: str | None = None         # the try-first as the plan's first step, when alone it is not the plan


@dataclass
class PlanStep:
    title: str
    peak_allocated_bytes: int
    peak_reserved_bytes: int | None
    fits: bool
    source: str                          # replay | formula


@dataclass
class PlanView:
    """The cheapest combination of remedies that fits (analyzer.diagnose.plan), one change a step."""

    fits: bool
    steps: list[PlanStep]
    alternatives: list[tuple[str, int, str]]   # (the changes, predicted peak, what they cost beside memory)


@dataclass
class FragmentationView:
    where: str                          # "at the out-of-memory" or "at the end of the recording"
    reserved_bytes: int | None
    allocated_bytes: int | None
    inactive_bytes: int | None
    largest_free_block_bytes: int | None
    request_bytes: int | None
    expandable_segments: bool | None
    segments: list[dict[str, int]]      # largest free bytes first, with used_share for drawing
    segments_left_out: int
    other: list[Detail]                 # further measures the diagnosis gives (internal, external bytes ...)

    @property
    def request_blocked(self) -> bool:
        """The request was larger than any free block although the free blocks together could hold it."""
        return (self.request_bytes is not None and self.largest_free_block_bytes is not None
                and self.inactive_bytes is not None
                and self.largest_free_block_bytes < self.request_bytes <= self.inactive_bytes)


@dataclass
class TheoryRow:
    name: str
    measured_bytes: int | None
    expected_bytes: int | None


@dataclass
class Table:
    name: str
    columns: list[str]
    rows: list[list[str]]


@dataclass
class TheoryView:
    rows: list[TheoryRow]
    facts: list[Detail]
    tables: list[Table]                 # lists of records (e.g. one row per precision regime)
    notes: list[str]


@dataclass
class OomView:
    requested_bytes: int
    device_free_bytes: int | None
    when: str
    event_index: int
    count: int
    where: str | None


@dataclass
class DeviceView:
    device: int
    name: str
    verdict: str
    headline: str
    peak_allocated_bytes: int
    demand_bytes: int                   # what the run needed: the peak, or allocated + the request at the OOM
    peak_requested_bytes: int
    peak_reserved_bytes: int | None     # None: the input records no reserved bytes (`reserved`)
    reserved_peak_bytes: int | None
    peak_when: str
    peak_event: int
    trace_entries: int
    live_count: int
    capacity_bytes: int | None
    end: EndState                       # None: the input does not record it (a profiler trace has no blocks)
    oom: OomView | None
    by_category: list[Share]
    by_phase: list[Share]
    by_module: list[Share]
    modules: list[ModuleNode]
    chart: Chart | None
    live: list[LiveAllocation]
    live_left_out: tuple[int, int]      # (count, bytes) of live allocations not listed
    sites: list[Site]
    findings: list[FindingView]
    remedies: list[RemedyView]
    fragmentation: FragmentationView
    theory: TheoryView | None
    steps: list[StepPeak]
    steps_left_out: int
    remedies_heading: str = "what to change, cheapest first"   # or, for a run that fits, ways to grow it
    workload: str = ""                  # what the advice was chosen for (analyzer.diagnose.workload)
    plan: PlanView | None = None        # when no run as it is fits: the combined changes that do


@dataclass
class InputView:
    path: str
    kind: str
    torch_era: str
    has_history: bool
    alloc_conf: str | None
    expandable_segments: bool | None
    settings: list[Detail]
    devices: list[dict[str, Any]]
    rank: int | None
    world_size: int | None


@dataclass(frozen=True)
class RecordingRow:
    """One of several unrelated recordings analysed together: what it is and what its analysis found."""

    label: str
    kind: str
    peak_bytes: int | None     # its fullest GPU's peak (None: no GPU memory recorded)
    device: str | None         # that GPU
    verdict: str


@dataclass
class ComparisonView:
    """One GPU or rank far above the others (analyzer.diagnose.imbalance): what makes the gap, what evens it."""

    summary: str
    remedies: list[str]


@dataclass
class ReportView:
    verdict: str
    devices: list[DeviceView]
    input: InputView
    warnings: list[str]
    version: str = __version__
    lead_device: int | None = None       # the device the verdict is about
    comparison: ComparisonView | None = None  # the devices (or ranks) compared, where one stands out
    sections: list[int] | None = None    # the devices shown in full (None: all); the others only in the overview
    recordings: list[RecordingRow] | None = None  # files that are not one job's ranks: one row each, in order

    def in_full(self) -> list[DeviceView]:
        return [d for d in self.devices if self.sections is None or d.device in self.sections]


def with_imbalance(verdict: str, imbalance: ImbalanceFinding | None, lead: str) -> str:
    """The verdict about the lead device, told that this device is the one far above the others."""
    if imbalance is None or imbalance.evidence.details.worst != lead:
        return verdict
    details = imbalance.evidence.details
    return (f"{verdict} {lead} peaks at {details.ratio:.1f}x the median device ({details.median}): "
            f"an imbalance, see below.")


def comparison_view(imbalance: ImbalanceFinding | None) -> ComparisonView | None:
    if imbalance is None:
        return None
    return ComparisonView(summary=imbalance.summary, remedies=list(imbalance.remedies))


def build_view(analysis: Analysis) -> ReportView:
    """Everything a report shows, for every device of the analysis."""
    trace = analysis.trace
    low, high, budget = CHART_POINTS
    points = min(high, max(low, budget // max(len(analysis.devices), 1)))  # the file stays small on 8 GPUs
    devices = worst_first([_device_view(analysis, d, points) for d in analysis.devices])
    lead = analysis.lead  # host memory last: it is never the patient beside a GPU
    if lead is None:
        verdict = "The input holds no allocations and no history on any device."
    else:
        view = next(v for v in devices if v.device == lead.device)
        named = len(devices) == 1 or view.name in view.verdict
        verdict = with_imbalance(view.verdict if named else f"{view.name}: {view.verdict}", analysis.imbalance,
                                 view.name)
    return shown(ReportView(verdict=verdict, devices=devices, input=_input_view(trace),
                            warnings=list(analysis.warnings), lead_device=None if lead is None else lead.device,
                            comparison=comparison_view(analysis.imbalance)))


def worst_first(devices: list[DeviceView]) -> list[DeviceView]:
    """The devices a reader should look at first: those that ran out of memory, then the fullest (of its capacity
    where known), host memory last."""
    def fullness(d: DeviceView) -> float:
        return d.peak_allocated_bytes / d.capacity_bytes if d.capacity_bytes else 0.0

    return sorted(devices, key=lambda d: (d.device < 0, d.oom is None, -fullness(d), -d.peak_allocated_bytes,
                                          d.device))


def _device_view(analysis: Analysis, d: DeviceAnalysis, chart_points: int) -> DeviceView:
    trace = analysis.trace
    origin = trace.time_origin_us
    live = d.peak.live
    shown = live.head(LIVE_SHOWN)
    steps = d.steps[:STEPS_SHOWN]
    return DeviceView(
        device=d.device, name=trace.device_label(d.device),
        verdict=d.diagnosis.verdict, headline=d.headline(),
        peak_allocated_bytes=d.peak.allocated_bytes,
        demand_bytes=d.diagnosis.demand_bytes,
        peak_requested_bytes=d.peak.requested_bytes,
        peak_reserved_bytes=d.peak.reserved_bytes if d.reserved_recorded else None,
        reserved_peak_bytes=d.reserved_peak_bytes if d.reserved_recorded else None,
        peak_when=relative_seconds(d.peak.time_us, origin), peak_event=d.peak.event_index,
        trace_entries=d.trace_entries, live_count=len(live), capacity_bytes=d.capacity_bytes, end=d.end.copy(),
        oom=_oom_view(d, origin),
        by_category=_shares(d.by_category, category_color, words),
        by_phase=_shares(d.by_phase, phase_color, words),
        by_module=_shares(d.by_module, lambda _: MODULE_COLOR, module_in_sentence),
        modules=d.module_tree,
        chart=_chart(analysis, d, chart_points) if d.trace_entries else None,
        live=[_live_allocation(trace, r, origin) for r in shown.itertuples(index=False)],
        live_left_out=(len(live) - len(shown), int(live["allocated_bytes"].sum() - shown["allocated_bytes"].sum())),
        sites=[Site(s["top_user_frame"], s["allocations"], s["bytes"], s["share"]) for s in d.by_site],
        findings=sorted((_finding_view(f, origin) for f in d.diagnosis.findings),
                        key=lambda f: (SEVERITY_ORDER.get(f.severity, 3), -(f.bytes or 0))),
        remedies=sorted((_remedy_view(r) for r in d.diagnosis.remedies),
                        key=lambda r: (r.rank is None, r.rank or 0, -(r.saved_bytes or 0))),
        fragmentation=_fragmentation_view(d, trace),
        theory=_theory_view(d.diagnosis.theory),
        steps=steps, steps_left_out=len(d.steps) - len(steps),
        remedies_heading=("optional: ways to grow the batch or the model (it fits as it is)" if d.diagnosis.fits
                          else "what to change, cheapest first"),
        workload=d.diagnosis.workload.summary,
        plan=_plan_view(d.diagnosis.plan),
    )


def _plan_view(found: Plan | None) -> PlanView | None:
    if not found:
        return None
    steps = [PlanStep(str(s["title"]), int(s["predicted_peak_allocated_bytes"]),
                      _optional_int(s["predicted_peak_reserved_bytes"]), bool(s["fits"]), str(s["source"]))
             for s in found["steps"]]
    alternatives = [(" + ".join(map(str, a["titles"])), int(a["predicted_peak_allocated_bytes"]),
                     "; ".join(c["throughput"] + ("" if c["communication"] == "none" else f", {c['communication']}")
                               for c in a["cost"].values())) for a in found["alternatives"]]
    return PlanView(bool(found["fits"]), steps, alternatives)


def _shares(rows: list[SplitRow], color: Callable[[str], str], label: Callable[[str], str]) -> list[Share]:
    return [Share(r["name"], label(r["name"]), int(r["bytes"]), float(r["share"]), color(r["name"])) for r in rows]


def _oom_view(d: DeviceAnalysis, origin: int | None) -> OomView | None:
    if d.oom is None:
        return None
    return OomView(requested_bytes=d.oom.requested_bytes, device_free_bytes=d.oom.device_free_bytes,
                   when=relative_seconds(d.oom.time_us, origin), event_index=d.oom.event_index, count=d.oom.count,
                   where=d.oom.top_user_frame)


def _chart(analysis: Analysis, d: DeviceAnalysis, max_points: int) -> Chart:
    trace = analysis.trace
    timeline = trace.timeline[trace.timeline["device"] == d.device]
    columns = [c for c in timeline.columns if c.endswith("_bytes") and c not in
               ("allocated_bytes", "requested_bytes", "reserved_bytes") and timeline[c].any()]
    categories = sorted((c[: -len("_bytes")] for c in columns), key=category_rank)
    reserved = ["reserved_bytes"] if d.reserved_recorded else []   # no line for the allocator model's estimate
    points = downsample(timeline, max_points)[["seq", "allocated_bytes", *reserved, *columns]]
    return Chart(
        title=f"{trace.device_label(d.device)}: memory over time",
        points=points.reset_index(drop=True),
        categories=[(c, f"{c}_bytes", category_color(c)) for c in categories],
        bands=_phase_bands(d.labels["phase"], points["seq"]),
        peak_seq=d.peak.event_index, peak_bytes=d.peak.allocated_bytes,
        oom_seq=d.oom.event_index if d.oom else None, capacity_bytes=d.capacity_bytes,
    )


def _phase_bands(phases: pd.Series, seqs: pd.Series) -> list[Band]:
    """Runs of one phase over the drawn points; runs too narrow to see join the run before them."""
    seq = [int(s) for s in seqs if s >= 0]
    if not seq:
        return []
    runs: list[list[Any]] = []   # [start, end, phase]
    for s, nxt in zip(seq, seq[1:] + [seq[-1] + 1], strict=True):
        phase = phases.iat[s] if s < len(phases) else None
        phase = None if pd.isna(phase) or phase == UNATTRIBUTED else str(phase)
        if runs and runs[-1][2] == phase:
            runs[-1][1] = nxt
        else:
            runs.append([s, nxt, phase])
    min_width = (seq[-1] + 1 - seq[0]) * BAND_MIN_WIDTH
    merged: list[list[Any]] = []
    for run in runs:
        if merged and (run[1] - run[0] < min_width or merged[-1][2] == run[2]):
            merged[-1][1] = run[1]
        else:
            merged.append(run)
    return [Band(start, end, phase, phase_color(phase)) for start, end, phase in merged if phase is not None]


def _live_allocation(trace: MemoryTrace, r: Any, origin: int | None) -> LiveAllocation:
    frames = trace.stack_frames(r.stack_id)
    framed = not pd.isna(r.stack_id)
    where = trace.stacks["top_user_frame"].iat[int(r.stack_id)] if framed else None
    op = trace.stacks["op"].iat[int(r.stack_id)] if framed else None
    when = ("before the recording started" if pd.isna(r.t_alloc_us)
            else relative_seconds(int(r.t_alloc_us), origin))
    return LiveAllocation(
        allocated_bytes=int(r.allocated_bytes), requested_bytes=int(r.requested_bytes), category=str(r.category),
        phase=str(r.phase), module=str(r.module), where=where, op=op,
        frames=[Frame(format_frame(f), is_user_frame(f)) for f in frames[:FRAMES_SHOWN]],
        frames_left_out=max(len(frames) - FRAMES_SHOWN, 0), allocated_at=when,
    )


def _span(values: Any, fmt) -> str | None:
    if not isinstance(values, (list, tuple)) or len(values) != 2 or values[0] is None:
        return None
    start = fmt(values[0])
    end = start if values[1] is None else fmt(values[1])
    return start if start == end else f"{start} – {end}"


def _detail_text(name: str, value: Any) -> str:
    """A value of a finding's or a theory's details as a reader wants it: sizes in binary units, shares in
    percent, a list as its first few items."""
    if isinstance(value, dict):
        return ", ".join(f"{words(k)} {_detail_text(k, v)}" for k, v in value.items())
    if isinstance(value, (list, tuple)):
        items = [_detail_text(name, v) for v in value[:DETAIL_ITEMS]]
        more = f"; … {len(value) - DETAIL_ITEMS} more" if len(value) > DETAIL_ITEMS else ""
        return "; ".join(items) + more
    if value is None:
        return "unknown"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if not isinstance(value, (int, float)):
        return str(value)
    if name == "bytes" or name.endswith("_bytes"):
        return human_bytes(value)
    if name.endswith(("share", "fraction", "ratio")) and 0 <= value <= 1:
        return f"{value:.0%}"
    if isinstance(value, int) or abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.3g}"


def _finding_view(f: Finding[Details], origin: int | None) -> FindingView:
    evidence = f.evidence
    allocations = [EvidenceAllocation(a["bytes"], a["top_user_frame"], a["op"], a["module"], a["category"])
                   for a in evidence.allocations or []]
    details = [Detail(words(k), _detail_text(k, v)) for k, v in evidence.details.to_json().items()]
    return FindingView(
        kind=f.kind.value, severity=f.severity, bytes=f.bytes, summary=f.summary,
        when=_span(evidence.time_us, lambda t: relative_seconds(int(t), origin)),
        events=_span(evidence.event_index, lambda e: str(int(e))),
        allocations=allocations, details=details,
    )


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _remedy_view(r: ListedRemedy) -> RemedyView:
    return RemedyView(
        id=r["id"], rank=r["rank"], title=r["title"], saved_bytes=r["saved_bytes"],
        new_peak_bytes=r["new_peak_bytes"], fits=r["fits"], confidence=r["confidence"], try_first=r["try_first"],
        how=r["how"], cost=r["cost"], note=r["note"], plan_step=r["plan_step"],
    )


def _fragmentation_view(d: DeviceAnalysis, trace: MemoryTrace) -> FragmentationView:
    """The diagnosed fragmentation when there is one; else the end state, which is the state at an OOM that
    ended the run (the allocator has released its cached segments by then)."""
    measured = d.diagnosis.fragmentation
    if measured:
        segments = sorted(measured.segments, key=lambda s: -s.free_bytes)
        shown = [{**asdict(s), "used_share": (s.used_bytes / s.bytes) if s.bytes else 0.0}
                 for s in segments[:SEGMENTS_SHOWN]]
        other = {"internal_bytes": measured.internal_bytes, "external_bytes": measured.external_bytes,
                 "cached_free_segments_bytes": measured.cached_free_segments_bytes,
                 "segments_recorded": measured.segments_recorded}
        return FragmentationView(
            where="at the out-of-memory" if d.oom else "at the peak",
            reserved_bytes=measured.reserved_bytes, allocated_bytes=measured.allocated_bytes,
            inactive_bytes=measured.inactive_bytes, largest_free_block_bytes=measured.largest_free_block_bytes,
            request_bytes=measured.request_bytes, expandable_segments=measured.expandable_segments,
            segments=shown, segments_left_out=len(segments) - len(shown),
            other=[Detail(words(k), _detail_text(k, v)) for k, v in other.items()],
        )
    end = d.end
    return FragmentationView(
        where="at the end of the recording", reserved_bytes=end["reserved_bytes"],
        allocated_bytes=end["allocated_bytes"], inactive_bytes=end["inactive_bytes"],
        largest_free_block_bytes=end["largest_free_block_bytes"],
        request_bytes=d.oom.requested_bytes if d.oom else None,
        expandable_segments=trace.allocator_settings.get("expandable_segments"), segments=[], segments_left_out=0,
        other=[],
    )


def _theory_view(theory: Theory) -> TheoryView:
    """Each category's measured bytes; the regime that agrees as a fact, and one row per regime checked."""
    return TheoryView(
        rows=[TheoryRow(words(k.removesuffix("_bytes")), v, None) for k, v in theory.measured().items()],
        facts=[] if theory.regimes is None else [Detail(words("regime"), _detail_text("regime", theory.regime))],
        tables=[_table("regimes", [asdict(r) for r in theory.regimes])] if theory.regimes else [],
        notes=list(theory.notes))


def _table(name: str, records: list[dict[str, Any]]) -> Table:
    columns = list(dict.fromkeys(k for r in records for k in r))
    return Table(words(name), [words(c) for c in columns],
                 [[_detail_text(c, r.get(c, "")) for c in columns] for r in records])


def _input_view(trace: MemoryTrace) -> InputView:
    settings = trace.allocator_settings or {}
    return InputView(
        path=trace.source_path, kind=trace.source_kind, torch_era=trace.torch_era, has_history=trace.has_history,
        alloc_conf=settings.get("PYTORCH_CUDA_ALLOC_CONF"), expandable_segments=settings.get("expandable_segments"),
        settings=[Detail(str(k), str(v)) for k, v in settings.items()],
        devices=[{"name": trace.device_label(i), "model": info.name if i >= 0 else None,
                  "capacity_bytes": info.capacity_bytes, "trace_entries": info.trace_entries,
                  "history_truncated": info.history_truncated} for i, info in sorted(trace.devices.items())],
        rank=trace.rank, world_size=trace.world_size,
    )
