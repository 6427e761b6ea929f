"""A run's peak in a few kilobytes: what the gate compares, and the baseline file a repository keeps.

A `RunPeaks` holds, per device, the memory the run needed (its allocated peak, or at an OOM allocated plus the
request that failed) and that peak's breakdowns by category, phase and module, its largest allocation sites, the
peak of every step, the kinds of finding, and the remedies with the peak each predicts: never the events.
Every breakdown is the analysis's own and sums to the allocated peak it splits (the module split keeps its
folded "other (N modules)" row for that reason).

The baseline file is that, as JSON under `"schema": "analyzer-baseline/1"`. Later versions add fields and never
rename or drop these; a file of a version this code does not know is refused (exit code 2), not misread.
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any

from analyzer.errors import CorruptInput

BASELINE_SCHEMA = "analyzer-baseline/1"
BASELINE_PREFIX = "analyzer-baseline/"
#: a split's folded tail ("other (41 modules)"): kept so the split sums to its total, never compared by name
FOLDED = re.compile(r"^other \(\d+ \w+\)$")
NO_FRAME = "(no Python frame)"   # the site of allocations recorded without a Python frame


class Kind(str, Enum):
    """What a run's peaks were read from."""

    RECORDING = "recording"    # anything analyze reads, analysed here
    ANALYSIS = "analysis"      # an analyzer/1 JSON result (analyze --format json)
    BASELINE = "baseline"      # a baseline file (analyze check --write-baseline)
    MEGATRON = "megatron"      # Megatron-LM functional tests' golden values: the peak by step, no breakdown
    LOG = "log"                # a training log: its OOMs and memory lines, no breakdown


@dataclass(frozen=True)
class Site:
    """A user line that made memory live at the peak, and how much."""

    site: str
    bytes: int
    allocations: int


@dataclass(frozen=True)
class StepPeak:
    step: int
    bytes: int


@dataclass(frozen=True)
class Option:
    """A remedy and the peak it predicts (None: it cannot say), or one step of a plan with the peak after it."""

    id: str
    title: str
    new_peak_bytes: int | None


@dataclass(frozen=True)
class Plan:
    """The cheapest combination of remedies that fits `capacity_bytes` (analyzer.diagnose.plan), step by step."""

    capacity_bytes: int
    steps: tuple[Option, ...]


@dataclass(frozen=True)
class DevicePeak:
    """One device's peak, what it is made of, and what would lower it."""

    device: int
    rank: int | None
    needed_bytes: int                  # the gated number: the allocated peak, or allocated + request at an OOM
    peak_bytes: int                    # allocated at the peak: what the breakdowns split
    reserved_bytes: int | None
    oom: bool
    step: int | None
    phase: str | None
    module: str | None
    by_category: dict[str, int] = field(default_factory=dict)
    by_phase: dict[str, int] = field(default_factory=dict)
    by_module: dict[str, int] = field(default_factory=dict)
    sites: tuple[Site, ...] = ()
    steps: tuple[StepPeak, ...] = ()
    findings: tuple[str, ...] = ()
    remedies: tuple[Option, ...] = ()  # in the analysis's order: the cost order, cheapest first
    plan: Plan | None = None

    @property
    def label(self) -> str:
        """'cuda:0', or 'rank 3 cuda:0' for a device of a set of ranks."""
        return f"cuda:{self.device}" if self.rank is None else f"rank {self.rank} cuda:{self.device}"


@dataclass(frozen=True)
class RunPeaks:
    """Every device of one run, where it was read from and what kind of input that was."""

    source: str
    kind: Kind
    devices: tuple[DevicePeak, ...]
    warnings: tuple[str, ...] = ()

    def to_baseline(self) -> dict[str, Any]:
        """The baseline file's document."""
        return {"schema": BASELINE_SCHEMA, "source": self.source,
                "devices": [asdict(d) for d in self.devices]}


def from_document(document: dict[str, Any], source: str, kind: Kind = Kind.ANALYSIS,
                  gpu_memory: int | None = None) -> RunPeaks:
    """The peaks of an analyzer/1 document (`Analysis.to_json()`, `analyze --format json`): every GPU's (host
    memory, device -1, is no GPU's). The plan is kept only for a recording analysed here, whose device memory is
    known (`gpu_memory`, else the document's): a JSON result does not say which memory its plan was made for."""
    try:
        devices = tuple(_device_of(d, kind is Kind.RECORDING, gpu_memory) for d in document["devices"]
                        if int(d["device"]) >= 0)
        warnings = tuple(str(w) for w in document.get("warnings", []))
    except MALFORMED as error:
        raise CorruptInput(source, f"an analyzer/1 result whose devices are malformed ({_what(error)})",
                           "Pass the unedited output of analyze FILE --format json.") from None
    return RunPeaks(source, kind, devices, warnings)


#: what reading a malformed document raises: a missing field, a value of the wrong type, an infinite size
MALFORMED = (KeyError, TypeError, ValueError, AttributeError, OverflowError)


def _what(error: Exception) -> str:
    if isinstance(error, KeyError):
        return f"the field {error.args[0]!r} is missing"
    return str(error)[:120]


def _device_of(d: dict[str, Any], analysed_here: bool, gpu_memory: int | None) -> DevicePeak:
    peak = d["peak"]
    plan = d.get("plan") if analysed_here else None
    capacity = gpu_memory or d.get("capacity_bytes")
    return DevicePeak(
        device=int(d["device"]), rank=d.get("rank"), needed_bytes=int(d["demand_bytes"]),
        peak_bytes=int(peak["allocated_bytes"]), reserved_bytes=_int(d.get("reserved_peak_bytes")),
        oom=d.get("oom") is not None, step=peak.get("step"), phase=peak.get("phase"), module=peak.get("module"),
        by_category=_split(peak["by_category"]), by_phase=_split(peak["by_phase"]),
        by_module=_split(peak["by_module"]),
        sites=tuple(Site(str(s["top_user_frame"] or NO_FRAME), int(s["bytes"]), int(s["allocations"]))
                    for s in peak.get("by_site", [])),
        steps=tuple(StepPeak(int(s["step"]), int(s["peak_allocated_bytes"])) for s in d.get("steps", [])
                    if s.get("step") is not None),
        findings=tuple(sorted({str(f["kind"]) for f in d.get("findings", [])})),
        remedies=tuple(Option(str(r["id"]), str(r["title"]), _int(r.get("new_peak_bytes")))
                       for r in d.get("remedies", [])),
        plan=None if not plan or not plan.get("fits") or capacity is None else Plan(int(capacity), tuple(
            Option(str(s["remedy"]), str(s["title"]), _int(s["predicted_peak_allocated_bytes"]))
            for s in plan["steps"])))


def _split(rows: dict[str, Any]) -> dict[str, int]:
    return {str(name): int(b) for name, b in rows.items()}


def _int(value: Any) -> int | None:
    return None if value is None else int(value)


def from_baseline(document: dict[str, Any], source: str) -> RunPeaks:
    """A baseline file's peaks; a version this code does not know is refused rather than misread."""
    schema = document.get("schema")
    if schema != BASELINE_SCHEMA:
        raise CorruptInput(source, f"a baseline of version {str(schema)[:40]!r}, which this analyzer does not read "
                           f"(it reads {BASELINE_SCHEMA})", "Write it again with this version: analyze check RUN "
                           "--write-baseline FILE.")
    try:
        devices = tuple(_baseline_device(d) for d in document["devices"])
    except MALFORMED as error:
        raise CorruptInput(source, f"a baseline whose devices are malformed ({_what(error)})",
                           "Write it again: analyze check RUN --write-baseline FILE.") from None
    return RunPeaks(source, Kind.BASELINE, devices)


def _baseline_device(d: dict[str, Any]) -> DevicePeak:
    plan = d.get("plan")
    return DevicePeak(
        device=int(d["device"]), rank=_int(d.get("rank")), needed_bytes=int(d["needed_bytes"]),
        peak_bytes=int(d["peak_bytes"]), reserved_bytes=_int(d.get("reserved_bytes")), oom=bool(d.get("oom")),
        step=_int(d.get("step")), phase=_str(d.get("phase")), module=_str(d.get("module")),
        by_category=_split(d.get("by_category", {})), by_phase=_split(d.get("by_phase", {})),
        by_module=_split(d.get("by_module", {})),
        sites=tuple(Site(str(s["site"]), int(s["bytes"]), int(s["allocations"])) for s in d.get("sites", [])),
        steps=tuple(StepPeak(int(s["step"]), int(s["bytes"])) for s in d.get("steps", [])),
        findings=tuple(str(f) for f in d.get("findings", [])),
        remedies=tuple(_option(r) for r in d.get("remedies", [])),
        plan=None if not plan else Plan(int(plan["capacity_bytes"]), tuple(_option(s) for s in plan["steps"])))


def _option(r: dict[str, Any]) -> Option:
    return Option(str(r["id"]), str(r["title"]), _int(r.get("new_peak_bytes")))


def _str(value: Any) -> str | None:
    return None if value is None else str(value)
