"""The result of an analysis: what was measured on each device, what the diagnosis made of it, and the JSON
contract behind `analyze --format json`.

Made once by `analyzer.pipeline.analyze` and never changed afterwards; reporters only render it.
`Analysis.to_json()` is versioned by `SCHEMA`: later versions add fields and never rename or drop these.
"""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Generic, Protocol, Sequence, TypedDict, TypeVar

import numpy as np
import pandas as pd

from analyzer.core.breakdown import SiteRow, SplitRow, StepPeak
from analyzer.core.module_tree import ModuleNode, module_in_sentence
from analyzer.core.timeline import Peak, allocated_by, live_at
from analyzer.core.trace import MemoryTrace
from analyzer.core.vocabulary import SCHEMA, UNATTRIBUTED, FindingKind, category_plural, names_module, phase_noun

TOP_ALLOCATIONS = 10
COMPOSITION_SHARE = 0.10  # of the peak: a smaller largest-known category does not describe it


@dataclass(frozen=True)
class OutOfMemory:
    """The last out-of-memory event of a device (the one that ended the run)."""

    requested_bytes: int
    device_free_bytes: int | None
    time_us: int | None
    event_index: int
    count: int                      # how many OOM entries the device recorded
    top_user_frame: str | None


class EndState(TypedDict):
    """The device at the end of the recording (analyzer.pipeline.end_state); None: the input does not record it
    (a profiler trace has no blocks, a memory timeline no reserved bytes)."""

    allocated_bytes: int
    requested_bytes: int
    reserved_bytes: int | None
    inactive_bytes: int | None
    largest_free_block_bytes: int | None


@dataclass(frozen=True, kw_only=True)
class DeviceMeasures:
    """What the recording shows of one device once every allocation is attributed: the diagnosis's input."""

    device: int
    peak: Peak
    reserved_peak_bytes: int
    end: EndState
    trace_entries: int
    history_truncated: bool
    oom: OutOfMemory | None
    recorded_capacity_bytes: int | None    # what the input says the device holds, if it says
    by_category: list[SplitRow]            # at the peak, largest first
    by_phase: list[SplitRow]
    by_module: list[SplitRow]              # top 20, the rest folded
    by_site: list[SiteRow]                 # the user lines that made the most of it, largest first
    module_tree: list[ModuleNode]          # the same bytes nested by module path (sums to the peak)
    peak_step: int | None
    peak_phase: str | None
    peak_module: str | None                # module of the allocation that made the peak
    steps: list[StepPeak]
    labels: pd.DataFrame = field(repr=False)  # step and phase after each event
    reserved_recorded: bool = True         # False: reserved figures are the running peak of allocated (an estimate)

    def headline(self) -> str:
        """'62% activations, forward of layers.11.mlp, step 1': what the peak is made of and where it is."""
        parts = []
        if self.by_category and self.by_category[0]["name"] != UNATTRIBUTED:
            top = self.by_category[0]
            parts.append(f"{top['share']:.0%} {top['name'].replace('_', ' ')}")
        where = phase_noun(self.peak_phase) if self.peak_phase not in (None, UNATTRIBUTED) else None
        module = module_in_sentence(self.peak_module) if names_module(self.peak_module) else None
        if where and module:
            parts.append(f"{where} of {module}")
        elif where or module:
            parts.append(where or f"in {module}")
        if self.peak_step is not None:
            parts.append(f"step {self.peak_step}")
        return ", ".join(parts)

    def composition(self) -> str:
        """'activations are 71% of the peak': the largest attributed category, in words; nothing when even that
        is under COMPOSITION_SHARE of the peak ('parameters are 2% of the peak' says nothing about it)."""
        top = next((r for r in self.by_category if r["name"] != UNATTRIBUTED), None)
        if top is None or top["share"] < COMPOSITION_SHARE:
            return ""
        return f"{category_plural(top['name'])} are {top['share']:.0%} of the peak"


class TopAllocation(TypedDict):
    """One of the largest allocations alive at a moment, with where it came from (analyzer.diagnose.evidence)."""

    bytes: int
    module: str
    category: str
    phase: str
    top_user_frame: str | None
    op: str | None


class PeakAllocation(TypedDict):
    """One of the largest allocations alive at the peak (analyzer.pipeline.top_allocations)."""

    allocated_bytes: int
    requested_bytes: int
    address: int
    t_alloc_us: int | None
    origin: str                           # trace | before_trace | end_state (analyzer.core.trace)
    top_user_frame: str | None
    op: str | None
    has_frames: bool


class LeakStack(TypedDict):
    """A user line whose allocations outlive each step (analyzer.diagnose.leak)."""

    top_user_frame: str
    module: str
    bytes_per_step: int
    steps_seen: int


class Details(Protocol):
    """A finding's own numbers (its evidence's `details`), named in the JSON reference."""

    def to_json(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class _Details:
    """Details written field by field, in their declared order."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


D = TypeVar("D", bound=Details, covariant=True)   # an OomFinding is a Finding[Details]


@dataclass(frozen=True, kw_only=True)
class Evidence(Generic[D]):
    """What shows a finding: when (µs, first and last), which events, the allocations involved, the numbers;
    None: the finding has none of that kind (the JSON leaves it out)."""

    details: D
    time_us: list[int | None] | None = None
    event_index: list[int] | None = None
    allocations: list[TopAllocation] | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {key: value for key, value in (("time_us", self.time_us), ("event_index", self.event_index),
                                                             ("allocations", self.allocations)) if value is not None}
        return out | {"details": self.details.to_json()}


@dataclass(frozen=True, kw_only=True)
class Finding(Generic[D]):
    """One finding (a detector's): what every finding has; each kind is a subclass with its own fields, keyed by
    KIND, written by `to_json` in JSON_KEYS' order (the analyzer/1 contract)."""

    KIND: ClassVar[FindingKind]
    #: "kind", then every field, in the JSON's order; a kind with fields of its own states its order
    JSON_KEYS: ClassVar[tuple[str, ...]] = ("kind", "severity", "bytes", "summary", "evidence")

    severity: str                         # critical | warning | info
    bytes: int
    summary: str
    evidence: Evidence[D]

    @property
    def kind(self) -> FindingKind:
        return self.KIND

    def to_json(self) -> dict[str, Any]:
        return {key: self.kind.value if key == "kind" else _finding_value(getattr(self, key)) for key in self.JSON_KEYS}


def _finding_value(value: Any) -> Any:
    return value.to_json() if isinstance(value, Evidence) else value


F = TypeVar("F", bound=Finding[Details])


def first_of(findings: Sequence[Finding[Details]], kind: type[F]) -> F | None:
    """The first finding of this kind, or None."""
    return next((f for f in findings if isinstance(f, kind)), None)


@dataclass(frozen=True, kw_only=True)
class OomDetails(_Details):
    requested_bytes: int
    device_free_bytes: int | None
    reserved_bytes: int
    allocated_bytes: int
    reserved_unallocated_bytes: int
    largest_free_block_bytes: int | None
    outside_pytorch_bytes: int | None
    capacity_bytes: int | None
    capacity_source: str
    expandable_segments: bool | None
    oom_top_user_frame: str | None


@dataclass(frozen=True, kw_only=True)
class OomFinding(Finding[OomDetails]):
    """The device's out-of-memory and its cause (analyzer.diagnose.oom)."""

    KIND = FindingKind.OOM
    JSON_KEYS = ("kind", "severity", "bytes", "verdict", "phase", "module", "step", "summary", "evidence")
    verdict: str                          # capacity | fragmentation | outside_pytorch
    phase: str | None                     # where it happened
    module: str | None
    step: int | None


@dataclass(frozen=True, kw_only=True)
class LeakDetails(_Details):
    measured_steps: list[int]
    levels: list[dict[str, int]]
    level_growth_per_step: int
    capacity_bytes: int | None
    largest_step_peak_bytes: int


@dataclass(frozen=True, kw_only=True)
class LeakFinding(Finding[LeakDetails]):
    """Memory every step keeps (analyzer.diagnose.leak)."""

    KIND = FindingKind.LEAK
    JSON_KEYS = ("kind", "severity", "summary", "bytes", "bytes_per_step", "steps_to_oom", "oom_step", "stacks",
                 "stack_count", "evidence")
    bytes_per_step: int                   # the rate
    steps_to_oom: int | None
    oom_step: int | None
    stacks: list[LeakStack]               # where the leaked memory was allocated
    stack_count: int


@dataclass(frozen=True, kw_only=True)
class ReservedGrowthDetails(_Details):
    measured_steps: list[int]
    levels: list[dict[str, int]]
    unused_reserve_growth_per_step: int
    reserved_peak_bytes: int


@dataclass(frozen=True, kw_only=True)
class ReservedGrowthFinding(Finding[ReservedGrowthDetails]):
    """The reserve growing step after step beyond what is kept (analyzer.diagnose.reserved_growth)."""

    KIND = FindingKind.RESERVED_GROWTH
    JSON_KEYS = ("kind", "severity", "bytes", "bytes_per_step", "steps_to_oom", "summary", "evidence")
    bytes_per_step: int
    steps_to_oom: int | None


@dataclass(frozen=True, kw_only=True)
class ActivationPeakDetails(_Details):
    share: float
    modules: list[SplitRow]
    steps: list[int]


@dataclass(frozen=True, kw_only=True)
class ActivationPeakFinding(Finding[ActivationPeakDetails]):
    """Activations are the largest category at the peak (analyzer.diagnose.activation_peak)."""

    KIND = FindingKind.ACTIVATION_PEAK


@dataclass(frozen=True, kw_only=True)
class OptimizerSpikeDetails(_Details):
    optimizer_peak_bytes: int
    peak_elsewhere_bytes: int
    lazy_state_bytes: int
    temporary_bytes: int
    parameter_bytes: int


@dataclass(frozen=True, kw_only=True)
class OptimizerSpikeFinding(Finding[OptimizerSpikeDetails]):
    """The optimizer step raises the peak (analyzer.diagnose.optimizer_spike)."""

    KIND = FindingKind.OPTIMIZER_SPIKE
    JSON_KEYS = ("kind", "severity", "bytes", "optimizer", "lazy_state_bytes", "temporary_bytes", "first_step",
                 "first_step_excess_bytes", "oom_in_first_step", "summary", "evidence")
    optimizer: str
    lazy_state_bytes: int
    temporary_bytes: int
    first_step: int | None
    first_step_excess_bytes: int | None
    oom_in_first_step: bool


@dataclass(frozen=True, kw_only=True)
class CheckpointGatherDetails(_Details):
    save_peak_bytes: int
    training_peak_bytes: int
    gathered_bytes: int


@dataclass(frozen=True, kw_only=True)
class CheckpointGatherFinding(Finding[CheckpointGatherDetails]):
    """Saving a checkpoint peaks above training (analyzer.diagnose.checkpoint_gather)."""

    KIND = FindingKind.CHECKPOINT_GATHER
    JSON_KEYS = ("kind", "severity", "bytes", "gathered_bytes", "summary", "evidence")
    gathered_bytes: int


@dataclass(frozen=True)
class FragmentationDetails:
    """The picture at the peak, as a finding's details (its segments aside)."""

    picture: FragmentationPicture

    def to_json(self) -> dict[str, Any]:
        return self.picture.details()


@dataclass(frozen=True, kw_only=True)
class FragmentationFinding(Finding[FragmentationDetails]):
    """Fragmentation that nearly caused an OOM (analyzer.diagnose.fragmentation)."""

    KIND = FindingKind.FRAGMENTATION
    JSON_KEYS = ("kind", "severity", "bytes", "summary", "evidence", "recoverable_bytes")
    recoverable_bytes: int


@dataclass(frozen=True, kw_only=True)
class OutsidePytorchDetails(_Details):
    outside_bytes_at_peak: int
    outside_bytes_max: int
    unseen_bytes_at_oom: int | None
    clock_offset_us: int
    outside_allocations: int
    notes: list[str]


@dataclass(frozen=True, kw_only=True)
class OutsidePytorchFinding(Finding[OutsidePytorchDetails]):
    """Device memory outside PyTorch, measured by a second recording (analyzer.diagnose.outside)."""

    KIND = FindingKind.OUTSIDE_PYTORCH
    JSON_KEYS = ("kind", "severity", "bytes", "significant", "summary", "evidence")
    significant: bool                     # the first thing to explain


@dataclass(frozen=True, kw_only=True)
class ConvWorkspaceDetails(_Details):
    unknown_bytes: int
    share: float
    largest_bytes: int
    lived_us: int


@dataclass(frozen=True, kw_only=True)
class ConvWorkspaceFinding(Finding[ConvWorkspaceDetails]):
    """A transient no tensor holds, most likely cuDNN's workspace (analyzer.diagnose.conv_workspace)."""

    KIND = FindingKind.CONV_WORKSPACE


@dataclass(frozen=True, kw_only=True)
class KVCacheDetails(_Details):
    share: float
    tensors: int
    layers: int
    quantized: bool


@dataclass(frozen=True, kw_only=True)
class KVCacheFinding(Finding[KVCacheDetails]):
    """A KV cache kept across the forward (analyzer.diagnose.kv_cache)."""

    KIND = FindingKind.KV_CACHE


class ImbalancePeak(TypedDict):
    """One device's peak as the imbalance finding lists it, worst first."""

    label: str
    peak_bytes: int
    oom: bool
    peak_step: int | None
    peak_phase: str | None


@dataclass(frozen=True, kw_only=True)
class ImbalanceDetails(_Details):
    worst: str
    median: str
    ratio: float
    worst_peak_bytes: int
    median_peak_bytes: int
    category: str | None
    category_gap_bytes: int
    module: str | None
    module_gap_bytes: int
    step: int | None
    median_at_that_step_bytes: int | None
    cause: str | None
    peaks: list[ImbalancePeak]


@dataclass(frozen=True, kw_only=True)
class ImbalanceFinding(Finding[ImbalanceDetails]):
    """One GPU or rank peaks far above the others (analyzer.diagnose.imbalance)."""

    KIND = FindingKind.IMBALANCE
    JSON_KEYS = ("kind", "severity", "bytes", "summary", "evidence", "remedies")
    remedies: list[str]                   # what evens the load


class _Fits(TypedDict):
    peak_bytes: int
    capacity_bytes: int
    headroom_bytes: int


class Fits(_Fits, total=False):
    """A run that fits as it is: its peak, the device it fits and the headroom left."""

    capacity_assumed: bool      # the device is not known: it fits the smallest GPU (remedies.SMALLEST_GPU)


class PlanStep(TypedDict):
    """One change of a plan, with the peak predicted after it (analyzer.diagnose.plan.step_json)."""

    remedy: str
    title: str
    value: int | None                     # k micro-batches, N GPUs, the ZeRO stage
    predicted_peak_allocated_bytes: int
    predicted_peak_reserved_bytes: int | None
    fits: bool
    source: str                           # formula | replay
    cost: dict[str, str]                  # throughput, communication, code


class PlanAlternative(TypedDict):
    """A fitting configuration a little dearer than the plan (analyzer.diagnose.plan.alternative_json)."""

    remedies: list[str]
    titles: list[str]
    predicted_peak_allocated_bytes: int
    source: str
    extra_cost: float
    cost: dict[str, dict[str, str]]


class _Plan(TypedDict):
    fits: bool
    steps: list[PlanStep]
    alternatives: list[PlanAlternative]
    searched: int                         # configurations in the lattice


class Plan(_Plan, total=False):
    """The cheapest combination of remedies that fits (analyzer.diagnose.plan)."""

    single: bool                          # a recording's: the plan is the list's cheapest single change
    replays: int
    cheapest_single: str | None           # set by plan.agree
    try_first: str


class Triage(TypedDict):
    """What kind of problem the device has (analyzer.diagnose.triage), in one sentence."""

    verdict: str      # outside_pytorch | leak | phase_spike | steady_state
    reason: str


class Replayed(TypedDict):
    """A remedy's run replayed through the allocator model (analyzer.diagnose.counterfactual)."""

    peak_allocated_bytes: int
    peak_reserved_bytes: int
    oom: bool | None                    # None: the device's memory is not known
    oom_at_event: int | None            # the recorded event the first failing request comes at (or after)


class ListedRemedy(TypedDict):
    """One remedy of a device's list (analyzer.diagnose.remedies.rank_remedies), as the JSON carries it."""

    id: str                             # a RemedyId
    rank: int                           # its place in the list, cheapest first
    title: str
    saved_bytes: int | None             # None: not quantified
    new_peak_bytes: int | None
    fits: bool | None                   # None: the device's memory is not known
    confidence: str                     # high | medium | low
    try_first: bool
    purpose: str                        # fix | grow (the run fits as it is)
    note: str | None                    # why it saves what a cheaper one saves
    how: str                            # the code
    cost: str
    saving_source: str                  # formula | replay
    replay: Replayed | None             # the replayed run, where a replay predicts the remedy
    plan_step: str | None               # set when it is the plan's first step, not the cheapest single change


@dataclass(frozen=True)
class FreeInSegment:
    """One segment at a moment of the fragmentation picture: its size, what its live blocks use, what is free in
    it and its largest free gap."""

    addr: int
    bytes: int
    used_bytes: int
    free_bytes: int
    largest_free_bytes: int


@dataclass(frozen=True, kw_only=True)
class FragmentationPicture:
    """Reserved memory that holds no tensor at one moment (analyzer.diagnose.fragmentation); None: the input does
    not record it (only a snapshot records segments)."""

    event_index: int
    reserved_bytes: int
    allocated_bytes: int
    inactive_bytes: int                   # reserved - allocated
    internal_bytes: int                   # allocated - requested: rounding inside blocks
    external_bytes: int | None            # free inside segments that also hold live blocks
    cached_free_segments_bytes: int | None
    largest_free_block_bytes: int | None  # None also where expandable segments have no fixed blocks
    request_bytes: int | None             # the failed request, at an OOM
    expandable_segments: bool | None
    segments_recorded: bool
    segments: list[FreeInSegment] = field(default_factory=list)  # the most free first, at most 50

    def details(self) -> dict[str, Any]:
        """The numbers, as the JSON and a finding's evidence carry them (segments aside)."""
        return {"event_index": self.event_index, "reserved_bytes": self.reserved_bytes,
                "allocated_bytes": self.allocated_bytes, "inactive_bytes": self.inactive_bytes,
                "internal_bytes": self.internal_bytes, "external_bytes": self.external_bytes,
                "cached_free_segments_bytes": self.cached_free_segments_bytes,
                "largest_free_block_bytes": self.largest_free_block_bytes, "request_bytes": self.request_bytes,
                "expandable_segments": self.expandable_segments, "segments_recorded": self.segments_recorded}

    def to_json(self) -> dict[str, Any]:
        return {**self.details(), "segments": [asdict(s) for s in self.segments]}


@dataclass(frozen=True, kw_only=True)
class SegmentsAt:
    """The allocator at one moment the HTML report pictures (the peak, an OOM): the numbers the JSON holds for it,
    and the segments drawn with the live blocks inside them (analyzer.diagnose.fragmentation.segments_pictured)."""

    title: str                            # "at the peak" / "at the out-of-memory (event N)"
    measured: FragmentationPicture
    segment_count: int                    # segments alive then, drawn or not
    segments: pd.DataFrame = field(repr=False)  # those drawn, most free first: addr, end, bytes, used_bytes,
    #                                             free_bytes, largest_free_bytes
    live: pd.DataFrame = field(repr=False)      # the live blocks by address: addr, allocated_bytes, requested_bytes


@dataclass(frozen=True)
class RegimeCheck:
    """Measured model states against 16Ψ under one precision assumption (analyzer.diagnose.theory)."""

    name: str
    parameters: float                     # Ψ implied by the measured parameter bytes
    expected_model_states_bytes: float    # 16Ψ
    measured_model_states_bytes: int
    agrees: bool                          # within 10%


@dataclass(frozen=True, kw_only=True)
class Theory:
    """Model states measured at their largest over the run, checked against 16Ψ (analyzer.diagnose.theory_check)."""

    parameter_bytes: int
    gradient_bytes: int
    optimizer_state_bytes: int
    activation_bytes: int
    notes: list[str]
    regimes: list[RegimeCheck] | None = None  # None: no parameters were identified, nothing to check
    regime: str | None = None                 # the first regime that agrees

    def measured(self) -> dict[str, int]:
        """{category}_bytes of each category measured, in the JSON's order."""
        return {"parameter_bytes": self.parameter_bytes, "gradient_bytes": self.gradient_bytes,
                "optimizer_state_bytes": self.optimizer_state_bytes, "activation_bytes": self.activation_bytes}

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {**self.measured(), "notes": list(self.notes)}
        if self.regimes is not None:
            out |= {"regimes": [asdict(r) for r in self.regimes], "regime": self.regime}
        return out


@dataclass(frozen=True, kw_only=True)
class WorkloadFacts:
    """What kind of run the advice was chosen for (analyzer.diagnose.workload.Workload.published)."""

    kind: str                        # training | forward_only | unknown
    frozen_share: float | None
    graph_kept: bool
    mixed_precision_on: bool | None
    gpus: int | None
    summary: str                     # the facts in words

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, kw_only=True)
class Diagnosis:
    """What the detectors, the triage, the theory check and the remedies made of one device's measures."""

    findings: list[Finding[Details]]
    remedies: list[ListedRemedy]
    verdict: str                          # one sentence: what ran out, where, why, what to try first
    theory: Theory                        # measured model states vs 16Ψ
    fragmentation: FragmentationPicture | None  # at the OOM, else at the reserved peak
    triage: Triage
    demand_bytes: int                     # what the run needed: peak, or allocated + request at the OOM
    capacity_bytes: int | None            # the device memory the advice was judged against
    capacity_source: str                  # where that number came from
    workload: WorkloadFacts               # analyzer.diagnose.workload: what the advice acts on
    fits: Fits | None = None              # when the run fits as it is
    plan: Plan | None = None              # the cheapest combination of remedies that fits (analyzer.diagnose.plan)


@dataclass(frozen=True, kw_only=True)
class DeviceAnalysis(DeviceMeasures):
    """One device: its measures and their diagnosis."""

    diagnosis: Diagnosis
    top_allocations: list[PeakAllocation]  # the largest allocations live at the peak, with where they came from
    segments_pictured: list[SegmentsAt] | None = None  # None: the input records no segments

    @property
    def capacity_bytes(self) -> int | None:
        """The device's memory: what the input records, else what the diagnosis judged against."""
        return self.recorded_capacity_bytes or self.diagnosis.capacity_bytes


@dataclass(frozen=True)
class Analysis:
    """One recording: every device that holds memory or history, and the warnings a reader of them must see."""

    trace: MemoryTrace
    devices: list[DeviceAnalysis]
    warnings: list[str] = field(default_factory=list)  # the reader's warnings, then the analysis's
    imbalance: ImbalanceFinding | None = None      # one GPU peaks far above the others (analyzer.diagnose.imbalance)

    def device(self, device: int) -> DeviceAnalysis:
        return next(d for d in self.devices if d.device == device)

    @property
    def lead(self) -> DeviceAnalysis | None:
        """The device a reader asks about first: the one that ran out of memory (the earliest), else the fullest
        GPU (host memory, device -1 in profiler traces, only when no GPU was recorded)."""
        if not self.devices:
            return None
        gpus = [d for d in self.devices if d.device >= 0]
        ooms = [(d.oom, d) for d in (gpus or self.devices) if d.oom is not None]
        if ooms:
            return min(ooms, key=lambda od: (od[0].time_us is None, od[0].time_us or 0, od[1].device))[1]
        return max(self.devices, key=lambda d: (d.device >= 0, d.peak.allocated_bytes, -d.device))

    # The pandas handles: what a pandas user reaches for, on the attributed tables (`device` None: `lead`).

    @property
    def allocations(self) -> pd.DataFrame:
        """Every allocation of the recording, labelled (module, phase, category, step): the attributed trace's
        table. The trace passed to `analyze` is left bare; this one is not."""
        return self.trace.allocations

    def live_at(self, seq: int, device: int | None = None) -> pd.DataFrame:
        """The allocations of `device` alive just after event `seq` (-1: before the first event), largest first,
        each with the category in force then and the user line that made it (`top_user_frame`)."""
        return self._framed(live_at(self.trace, self._pick(device).device, seq))

    def at_peak(self, device: int | None = None) -> pd.DataFrame:
        """The allocations alive at `device`'s peak, largest first: what the report's breakdowns sum."""
        return self._framed(self._pick(device).peak.live)

    def timeline(self, device: int | None = None) -> pd.DataFrame:
        """`device`'s allocated, requested and reserved bytes before the first event (seq -1) and after each
        one, one `<category>_bytes` column per category, and the `step` and `phase` in force."""
        d = self._pick(device)
        rows = self.trace.timeline[self.trace.timeline["device"] == d.device].reset_index(drop=True)
        labels = pd.concat([pd.DataFrame({"step": [np.nan], "phase": [None]}), d.labels], ignore_index=True)
        return rows.assign(step=pd.array(labels["step"].to_numpy()[: len(rows)], dtype="Int64"),
                           phase=labels["phase"].to_numpy(dtype=object)[: len(rows)])

    def by_category(self, device: int | None = None) -> pd.Series:
        """Bytes at `device`'s peak per category, largest first; sums to the peak's allocated bytes."""
        return self._at_peak_by("category", device)

    def by_phase(self, device: int | None = None) -> pd.Series:
        """Bytes at `device`'s peak per phase, largest first; sums to the peak's allocated bytes."""
        return self._at_peak_by("phase", device)

    def by_module(self, device: int | None = None) -> pd.Series:
        """Bytes at `device`'s peak per module (every module, none folded), largest first; sums to the peak."""
        return self._at_peak_by("module", device)

    def _at_peak_by(self, column: str, device: int | None) -> pd.Series:
        live = self._pick(device).peak.live
        sums = live.groupby(column, observed=True)["allocated_bytes"].sum()
        sums = sums[sums > 0].sort_values(ascending=False, kind="stable").astype(np.int64)
        sums.index = sums.index.astype(str)
        return sums.rename("allocated_bytes").rename_axis(column)

    def _pick(self, device: int | None) -> DeviceAnalysis:
        """The device asked for, or the lead one; a clear error naming those there are."""
        chosen = self.lead if device is None else next((d for d in self.devices if d.device == device), None)
        if chosen is None:
            there = ", ".join(str(d.device) for d in self.devices) or "none"
            raise KeyError(f"no device {device} in {self.trace.source_path} (devices: {there})")
        return chosen

    def _framed(self, rows: pd.DataFrame) -> pd.DataFrame:
        """`rows` with the user line that made each (`top_user_frame`; None without Python frames)."""
        frames = self.trace.stacks["top_user_frame"]
        where = rows["stack_id"].astype(object).map(lambda s: None if pd.isna(s) else frames.iat[int(s)])
        return rows.assign(top_user_frame=where.astype(object))

    def allocated_by(self, device: int, label: str) -> dict[str, np.ndarray]:
        """Allocated bytes of `device` per value of `label` (category, phase, module) before the first event
        and after each event: series that sum to the timeline's allocated bytes (built when asked for: only
        the counter tracks of --export-trace need them)."""
        rows = self.trace.allocations[self.trace.allocations["device"] == device]
        return allocated_by(rows, label, int((self.trace.events["device"] == device).sum()))

    def to_json(self) -> dict[str, Any]:
        """The `analyzer/1` JSON contract (see the docs' reference)."""
        return {
            "schema": SCHEMA,
            "source": {"path": self.trace.source_path, "kind": self.trace.source_kind,
                       "torch_era": self.trace.torch_era, "has_history": self.trace.has_history},
            "allocator_settings": _jsonable(self.trace.allocator_settings),
            "warnings": list(self.warnings),
            "devices": [_device_json(d) for d in self.devices],
            "imbalance": None if self.imbalance is None else self.imbalance.to_json(),
        }

    def to_json_text(self) -> str:
        return json.dumps(self.to_json(), indent=2)


@dataclass(frozen=True)
class Claim:
    """What one file says about its place in a job: its rank (file name, else metadata) and the world size."""

    name: str
    rank: int | None
    world_size: int | None


def not_one_job(claims: Sequence[Claim]) -> str | None:
    """Why these files are not the ranks of one job, or None when they are. Files are ranks of one job only when
    they say so: each names its rank (in its file name or its metadata), no rank twice, one world size that holds
    every rank; two profiling windows of one worker, or traces of different jobs in one folder, are not."""
    if len(claims) < 2:
        return None
    sizes = sorted({c.world_size for c in claims if c.world_size})
    if len(sizes) > 1:
        return f"their world sizes differ: {', '.join(map(str, sizes))}"
    counts = Counter(c.rank for c in claims if c.rank is not None)
    twice = sorted(rank for rank, n in counts.items() if n > 1)
    if twice:
        return f"rank {twice[0]} is in {counts[twice[0]]} files"
    unranked = [c.name for c in claims if c.rank is None]
    if unranked:
        more = f" and {len(unranked) - 1} more" if len(unranked) > 1 else ""
        return f"{unranked[0]}{more} name{'' if more else 's'} no rank"
    highest = max(c.rank for c in claims if c.rank is not None)
    if sizes and highest >= sizes[0]:
        return f"rank {highest} is outside a world of {sizes[0]}"
    return None


@dataclass(frozen=True)
class RankSetAnalysis:
    """A job recorded as one file per rank: one Analysis each, in rank order."""

    source_path: str
    ranks: list[Analysis]
    warnings: list[str] = field(default_factory=list)  # about the set itself (files that are not traces, ...)

    @property
    def separate(self) -> str | None:
        """Why these files are not the ranks of one job (not_one_job), or None when they are."""
        return not_one_job([Claim(Path(a.trace.source_path.rsplit("!", 1)[-1]).name, a.trace.rank, a.trace.world_size)
                            for a in self.ranks])   # an archive's member is named after its `!`

    def to_json(self) -> dict[str, Any]:
        """One analyzer/1 document for the job: every device carries its `rank`."""
        return ranks_document(self.source_path, [a.trace.rank for a in self.ranks],
                              [(a.trace.rank, f"rank {a.trace.rank}", a.to_json()) for a in self.ranks], self.warnings)

    def to_json_text(self) -> str:
        return json.dumps(self.to_json(), indent=2)


def ranks_document(source_path: str, ranks: Sequence[int | None],
                   documents: Sequence[tuple[int | None, str, dict[str, Any]]], warnings: Sequence[str]) -> dict[str, Any]:
    """One analyzer/1 document from each rank's own: its devices tagged with the rank, its warnings with the label.

    Shared by a rank set read in one process and a job analysed on workers, so both write the same document.
    """
    devices, said = [], list(warnings)
    for rank, label, document in documents:
        devices += [{**d, "rank": rank} for d in document["devices"]]
        said += [f"{label}: {w}" for w in document["warnings"]]
    return {"schema": SCHEMA, "source": {"path": source_path, "kind": "ranks", "ranks": list(ranks)},
            "allocator_settings": {}, "warnings": said, "devices": devices}


def _device_json(d: DeviceAnalysis) -> dict[str, Any]:
    dx = d.diagnosis
    return {
        "device": d.device,
        "capacity_bytes": d.capacity_bytes,
        "peak": {
            "allocated_bytes": d.peak.allocated_bytes, "requested_bytes": d.peak.requested_bytes,
            "reserved_bytes": d.peak.reserved_bytes, "time_us": d.peak.time_us, "event_index": d.peak.event_index,
            "live_allocations": int(len(d.peak.live)),
            "top_allocations": d.top_allocations,
            "by_category": {r["name"]: r["bytes"] for r in d.by_category},
            "by_phase": {r["name"]: r["bytes"] for r in d.by_phase},
            "by_module": {r["name"]: r["bytes"] for r in d.by_module},
            "by_site": d.by_site,
            "module_tree": [asdict(n) for n in d.module_tree],
            "step": d.peak_step, "phase": d.peak_phase, "module": d.peak_module,
            "summary": d.headline(),
        },
        "steps": d.steps,
        "reserved_peak_bytes": d.reserved_peak_bytes,
        "reserved_recorded": d.reserved_recorded,
        "end": d.end,
        "trace_entries": d.trace_entries,
        "history_truncated": d.history_truncated,
        "oom": None if d.oom is None else {
            "requested_bytes": d.oom.requested_bytes, "device_free_bytes": d.oom.device_free_bytes,
            "time_us": d.oom.time_us, "event_index": d.oom.event_index, "count": d.oom.count,
            "top_user_frame": d.oom.top_user_frame,
        },
        "verdict": dx.verdict,
        "triage": dx.triage,
        "demand_bytes": dx.demand_bytes,
        "workload": dx.workload.to_json(),
        "fits": dx.fits,
        "fragmentation": None if dx.fragmentation is None else dx.fragmentation.to_json(),
        "theory": dx.theory.to_json(),
        "findings": [f.to_json() for f in dx.findings],
        "remedies": dx.remedies,
        "plan": dx.plan,
    }


def _jsonable(value: Any) -> Any:
    """Allocator settings hold only plain values, but keys may be ints or tuples: make them JSON-safe."""
    return json.loads(json.dumps(value, default=str))
