"""Does a run hold its memory budget, or its baseline within a tolerance, and if not, what grew.

A device holds a budget when the memory it needed (its allocated peak, or at an OOM allocated plus the request
that failed) is at most the budget; it holds a baseline when that is at most the baseline's times
(1 + tolerance). The default tolerance is Megatron-LM's for `mem-max-allocated-bytes` (an approximate test with
rtol 0.05, tests/functional_tests/python_test_utils/test_pretraining_regular_pipeline.py), one-sided: a run
that needs less holds, and one that needs more than the tolerance less is told that its baseline is stale.

What is said on failure comes from the two summaries: the categories, phases and modules whose bytes at the
peak grew most, the allocation sites new or larger, the findings the baseline did not have, and the first
step whose running peak went past the baseline's at that step (or the budget). Over a budget there is nothing
to compare with: what the peak is made of is said instead, with the cheapest fix the analysis knows: its plan,
when it was made for this budget, else the first remedy in its cost order whose predicted peak fits.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from itertools import accumulate
from typing import Literal

from analyzer.diagnose.remedies import FIT_HEADROOM, LAYOUT_ONLY
from analyzer.gate.summary import FOLDED, DevicePeak, Kind, Option, RunPeaks, StepPeak

DEFAULT_TOLERANCE = 0.05
GREW = 0.01          # parameters or inputs at the peak grew by at least this share: the model or the batch changed
SQUARE_EXPONENT = 1.5  # a site grew as the square of the inputs when its ratio is at least (inputs ratio) ** this:
                       # halfway, in logarithm, between growing in proportion (1) and as the square (2)
TOP_CHANGES = 3   # categories, phases and modules named per device
TOP_SITES = 5     # allocation sites named per device

EXIT_HOLDS = 0
EXIT_FAILS = 1


@dataclass(frozen=True)
class Change:
    """Bytes of one name (a category, phase, module or site) at the peak, before and now; `before` is None when
    there is no baseline to compare with (a budget, or a baseline without breakdowns)."""

    name: str
    before: int | None
    after: int

    @property
    def delta(self) -> int:
        return self.after - (self.before or 0)

    @property
    def new(self) -> bool:
        return self.before == 0


class Cause(str, Enum):
    """A change between the runs that the two peaks show, whatever the run's code calls it."""

    LEAK = "leak"            # a leak finding the baseline did not have: memory kept from every step
    MODEL = "model"          # more parameter bytes: a larger or deeper model
    INPUTS = "inputs"        # more input bytes, the step's memory in proportion: a larger batch
    SEQUENCE = "sequence"    # more input bytes and a site grown as their square: a longer sequence (attention)


@dataclass(frozen=True)
class Likely:
    """One likely change, with the numbers that show it: the ratio of what grew and, for the model, the new
    modules; for a sequence, the site that grew as the square of the inputs and its ratio."""

    cause: Cause
    ratio: float | None = None
    evidence: tuple[str, ...] = ()
    evidence_ratio: float | None = None


@dataclass(frozen=True)
class Fix:
    """The cheapest way under the budget the analysis knows, step by step, and the peak it predicts."""

    steps: tuple[Option, ...]
    source: Literal["plan", "remedy"]   # the plan made for this budget, or one remedy of the list
    predicted_bytes: int


@dataclass(frozen=True)
class DeviceCheck:
    now: DevicePeak
    then: DevicePeak | None      # the baseline's device (None with a budget, or none to pair with)
    limit_bytes: int | None      # the most it may need: the budget, or the baseline's times (1 + tolerance)
    holds: bool
    categories: tuple[Change, ...] = ()
    phases: tuple[Change, ...] = ()
    modules: tuple[Change, ...] = ()
    sites: tuple[Change, ...] = ()
    new_findings: tuple[str, ...] = ()
    first_step_over: StepPeak | None = None   # the first step whose running peak is past the limit
    baseline_at_step: int | None = None       # the baseline's running peak at that step, when it has the step
    fix: Fix | None = None
    stale: bool = False          # it needs more than the tolerance less than the baseline: write a new one
    likely: tuple[Likely, ...] = ()

    @property
    def over_bytes(self) -> int:
        return self.now.needed_bytes - (self.limit_bytes or 0)


@dataclass(frozen=True)
class Check:
    """A run against a budget or a baseline: one verdict per device."""

    run: str
    devices: tuple[DeviceCheck, ...]
    budget_bytes: int | None = None
    baseline: str | None = None
    baseline_kind: Kind | None = None
    tolerance: float | None = None
    warnings: tuple[str, ...] = ()

    @property
    def holds(self) -> bool:
        return all(d.holds for d in self.devices)

    @property
    def exit_code(self) -> int:
        return EXIT_HOLDS if self.holds else EXIT_FAILS


def check_budget(run: RunPeaks, budget: int) -> Check:
    """Every device of the run against `budget` bytes."""
    return Check(run.source, tuple(_against_budget(d, budget) for d in run.devices), budget_bytes=budget,
                 warnings=run.warnings)


def _against_budget(d: DevicePeak, budget: int) -> DeviceCheck:
    holds = d.needed_bytes <= budget
    running = _running(d.steps)
    return DeviceCheck(
        now=d, then=None, limit_bytes=budget, holds=holds,
        categories=_changes(d.by_category, None, TOP_CHANGES), phases=_changes(d.by_phase, None, TOP_CHANGES),
        modules=_changes(d.by_module, None, TOP_CHANGES),
        sites=_changes({s.site: s.bytes for s in d.sites}, None, TOP_SITES),
        first_step_over=next((s for s in running if s.bytes > budget), None),
        fix=None if holds else cheapest_fix(d, budget))


def cheapest_fix(d: DevicePeak, budget: int) -> Fix | None:
    """The plan made for this budget (the run analysed with the budget as its device), else the first remedy of
    the list (cheapest first) whose predicted peak fits the budget as a remedy's must: within FIT_HEADROOM of
    it. Settings of the allocator lower no allocated peak, so they are never the fix. None: nothing known fits."""
    if d.plan is not None and d.plan.capacity_bytes == budget and d.plan.steps:
        last = d.plan.steps[-1].new_peak_bytes
        if last is not None:
            return Fix(d.plan.steps, "plan", last)
    for r in d.remedies:
        if r.new_peak_bytes is not None and r.id not in LAYOUT_ONLY and r.new_peak_bytes <= FIT_HEADROOM * budget:
            return Fix((r,), "remedy", r.new_peak_bytes)
    return None


def check_baseline(run: RunPeaks, baseline: RunPeaks, tolerance: float = DEFAULT_TOLERANCE) -> Check:
    """Every device of the run against the baseline's (paired by rank and device, or one to one)."""
    pairs, warnings = _pairs(run, baseline)
    devices = tuple(_against_baseline(now, then, tolerance) if then is not None else
                    DeviceCheck(now=now, then=None, limit_bytes=None, holds=True) for now, then in pairs)
    return Check(run.source, devices, baseline=baseline.source, baseline_kind=baseline.kind, tolerance=tolerance,
                 warnings=(*run.warnings, *warnings))


def _pairs(run: RunPeaks, baseline: RunPeaks) -> tuple[list[tuple[DevicePeak, DevicePeak | None]], list[str]]:
    if len(run.devices) == 1 and len(baseline.devices) == 1:
        return [(run.devices[0], baseline.devices[0])], []
    by_key = {(d.rank, d.device): d for d in baseline.devices}
    pairs = [(d, by_key.get((d.rank, d.device))) for d in run.devices]
    warnings = [f"{now.label} has no baseline and was not checked" for now, then in pairs if then is None]
    paired = {(now.rank, now.device) for now, _ in pairs}
    warnings += [f"{d.label} is in the baseline but not in the run" for d in baseline.devices
                 if (d.rank, d.device) not in paired]
    return pairs, warnings


def _against_baseline(now: DevicePeak, then: DevicePeak, tolerance: float) -> DeviceCheck:
    limit = int(then.needed_bytes * (1 + tolerance))
    compared = bool(then.by_category)   # Megatron-LM's golden values have the peak, not its breakdowns or findings
    over = _first_step_over(now, then, tolerance, limit)
    return DeviceCheck(
        now=now, then=then, limit_bytes=limit, holds=now.needed_bytes <= limit,
        categories=_changes(now.by_category, then.by_category if compared else None, TOP_CHANGES),
        phases=_changes(now.by_phase, then.by_phase if compared else None, TOP_CHANGES),
        modules=_changes(now.by_module, then.by_module if compared else None, TOP_CHANGES),
        sites=_changes({s.site: s.bytes for s in now.sites},
                       {s.site: s.bytes for s in then.sites} if compared else None, TOP_SITES),
        new_findings=tuple(f for f in now.findings if f not in then.findings) if compared else (),
        first_step_over=over, baseline_at_step=None if over is None else _running_at(then.steps, over.step),
        stale=now.needed_bytes < then.needed_bytes * (1 - tolerance), likely=likely_changes(now, then))


def likely_changes(now: DevicePeak, then: DevicePeak) -> tuple[Likely, ...]:
    """The changes the peaks show, strongest signal first: a new leak finding; parameters grown by GREW or more
    (the new modules named); inputs grown by GREW or more, a longer sequence when some allocation site present in
    both grew by at least (inputs ratio) ** SQUARE_EXPONENT (attention scores are b·h·s²), else a larger batch."""
    found = []
    if "leak" in now.findings and "leak" not in then.findings:
        found.append(Likely(Cause.LEAK))
    grown = _ratio(now.by_category, then.by_category, "parameter")
    if grown is not None and grown >= 1 + GREW:
        new = tuple(n for n in now.by_module if n not in then.by_module and not FOLDED.match(n))
        found.append(Likely(Cause.MODEL, grown, new))
    inputs = _ratio(now.by_category, then.by_category, "input")
    if inputs is not None and inputs >= 1 + GREW:
        before = {s.site: s.bytes for s in then.sites}
        ratios = sorted(((s.bytes / before[s.site], s.site) for s in now.sites if before.get(s.site)), reverse=True)
        if ratios and ratios[0][0] >= inputs ** SQUARE_EXPONENT:
            found.append(Likely(Cause.SEQUENCE, inputs, (ratios[0][1],), ratios[0][0]))
        else:
            found.append(Likely(Cause.INPUTS, inputs))
    return tuple(found)


def _ratio(now: dict[str, int], then: dict[str, int], name: str) -> float | None:
    return now.get(name, 0) / then[name] if then.get(name) else None


def _changes(now: dict[str, int], then: dict[str, int] | None, top: int) -> tuple[Change, ...]:
    """With a baseline, the names whose bytes grew most (new ones included); without, the largest now."""
    names = [n for n in now if not FOLDED.match(n)]
    if then is None:
        return tuple(Change(n, None, now[n]) for n in sorted(names, key=lambda n: -now[n])[:top])
    grown = [Change(n, then.get(n, 0), now[n]) for n in names if now[n] > then.get(n, 0)]
    return tuple(sorted(grown, key=lambda c: -c.delta)[:top])


def _running(steps: tuple[StepPeak, ...]) -> list[StepPeak]:
    """Each step with the running peak up to it (Megatron-LM logs that; per-step peaks become it)."""
    ordered = sorted(steps, key=lambda s: s.step)
    return [StepPeak(s.step, b) for s, b in zip(ordered, accumulate((s.bytes for s in ordered), max), strict=True)]


def _running_at(steps: tuple[StepPeak, ...], step: int) -> int | None:
    return next((s.bytes for s in _running(steps) if s.step == step), None)


def _first_step_over(now: DevicePeak, then: DevicePeak, tolerance: float, limit: int) -> StepPeak | None:
    """The first step whose running peak is past the baseline's at the same step by more than the tolerance;
    without steps in common, the first past the limit."""
    baseline = {s.step: s.bytes for s in _running(then.steps)}
    running = _running(now.steps)
    if any(s.step in baseline for s in running):
        return next((s for s in running if s.step in baseline and s.bytes > baseline[s.step] * (1 + tolerance)),
                    None)
    return next((s for s in running if s.bytes > limit), None)
