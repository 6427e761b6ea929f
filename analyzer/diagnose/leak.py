"""Leak: memory that every step adds and no later step frees (a loss kept with its autograd graph, outputs
appended to a list, activations cached on a module). A smaller batch only delays the OOM, so it is told apart
from a run that is simply too large before any sizing advice is given.

How: an allocation made in step k that is still alive at the end of the recording, though it is no model
state (parameter, gradient, optimizer state), was kept by that step. Kept allocations are grouped by where
they were allocated (top user frame and module); a group leaks when the measured steps (see `step_levels`)
keep memory in it repeatedly: in at least two of them and in at least half. The first step is never measured,
so the growth every run has once (lazy optimizer state, allocator warm-up, library workspaces) is not a leak.
The rate must also show at the step starts (what is alive besides the model states grows by at least half of
it: kept memory offset by frees elsewhere is not growth) and matter (at least 0.1% of a step's peak).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import pandas as pd

from analyzer.core.units import rate_bytes
from analyzer.core.vocabulary import names_module
from analyzer.diagnose.context import DeviceContext
from analyzer.diagnose.evidence import top_allocations
from analyzer.diagnose.step_levels import MIN_MEASURED_STEPS, MODEL_STATES, StepLevel, as_json, measured
from analyzer.result import Evidence, LeakDetails, LeakFinding, LeakStack

MIN_SHARE_OF_PEAK = 0.001   # a rate below this share of the largest step peak is noise, not a leak
LEVEL_AGREEMENT = 0.5       # the step-start levels must grow by at least this share of the kept rate
TOP_STACKS = 10
NO_FRAMES = "(no Python frames)"


def kept_allocations(ctx: DeviceContext) -> pd.DataFrame:
    """Allocations made in a training step and alive at the end of the recording, model states left out;
    with `frame` (top user frame) and `module` as strings, the keys leaks are grouped by."""
    a = ctx.allocations
    kept = a[a["seq_alloc"].notna() & a["seq_free"].isna() & a["step"].notna()]
    kept = kept[(kept["step"] >= 1) & ~kept["category"].isin(MODEL_STATES)]
    frames = ctx.trace.stacks["top_user_frame"]
    return kept.assign(
        frame=[NO_FRAMES if pd.isna(s) or frames.iat[int(s)] is None else frames.iat[int(s)] for s in kept["stack_id"]],
        module=kept["module"].astype(str))


def leaking(kept: pd.DataFrame, steps: list[int]) -> pd.DataFrame:
    """Groups (frame, module) that keep memory in enough of the measured `steps`: bytes_per_step, steps_seen."""
    in_steps = kept[kept["step"].isin(steps)]
    per_step = in_steps.groupby(["frame", "module", "step"])["allocated_bytes"].sum().unstack("step", fill_value=0)
    if per_step.empty:
        return pd.DataFrame(columns=["frame", "module", "bytes_per_step", "steps_seen"])
    seen = (per_step > 0).sum(axis=1)
    groups = pd.DataFrame({"bytes_per_step": per_step.sum(axis=1) / len(steps), "steps_seen": seen})
    needed = max(MIN_MEASURED_STEPS, math.ceil(len(steps) / 2))
    return groups[seen >= needed].sort_values("bytes_per_step", ascending=False, kind="stable").reset_index()


@dataclass(frozen=True)
class Leaking:
    """What leaks: the measured steps, the leaking groups (a user line and module each), their allocations, the
    rate they keep memory at and the growth of the step-start levels."""

    window: list[StepLevel]
    groups: pd.DataFrame
    leaked: pd.DataFrame
    rate: float
    growth: float


def find(ctx: DeviceContext, *, level_agreement: float = LEVEL_AGREEMENT,
         min_share_of_peak: float = MIN_SHARE_OF_PEAK) -> Leaking | None:
    """The leak at these thresholds, or None; measured once per device (the detector and the remedies ask)."""
    return ctx.memo(("leak", level_agreement, min_share_of_peak),
                    lambda: _find(ctx, level_agreement, min_share_of_peak))


def _find(ctx: DeviceContext, level_agreement: float, min_share_of_peak: float) -> Leaking | None:
    levels = ctx.step_levels
    window = measured(levels)
    if not window:
        return None
    steps = [lv.step for lv in window]
    kept = kept_allocations(ctx)
    groups = leaking(kept, steps)
    rate = float(groups["bytes_per_step"].sum())
    growth = (levels[-1].kept_bytes - window[0].kept_bytes) / len(window)
    largest_peak = max(lv.peak_allocated_bytes for lv in levels)
    if groups.empty or growth < level_agreement * rate or rate < min_share_of_peak * largest_peak:
        return None
    keys = set(zip(groups["frame"], groups["module"], strict=True))
    leaked = kept[[k in keys for k in zip(kept["frame"], kept["module"], strict=True)]]
    return Leaking(window, groups, leaked, rate, growth)


def detect(ctx: DeviceContext, *, level_agreement: float = LEVEL_AGREEMENT,
           min_share_of_peak: float = MIN_SHARE_OF_PEAK) -> list[LeakFinding]:
    """A leak: lines that keep memory in most measured steps, at a rate of at least `min_share_of_peak` of the
    largest step peak, the step-start levels growing by at least `level_agreement` of that rate."""
    found = find(ctx, level_agreement=level_agreement, min_share_of_peak=min_share_of_peak)
    if found is None:
        return []
    levels, window, groups, leaked = ctx.step_levels, found.window, found.groups, found.leaked
    steps, rate, growth = [lv.step for lv in window], found.rate, found.growth
    largest_peak = max(lv.peak_allocated_bytes for lv in levels)
    steps_to_oom = _steps_to_oom(ctx, rate)
    oom_step = None if steps_to_oom is None else levels[-1].step + steps_to_oom
    stacks: list[LeakStack] = [{"top_user_frame": g.frame, "module": g.module, "bytes_per_step": int(g.bytes_per_step),
               "steps_seen": int(g.steps_seen)} for g in groups.head(TOP_STACKS).itertuples()]
    return [LeakFinding(
        severity="critical",
        summary=(f"Memory grows by {rate_bytes(rate)} every step (steps {steps[0]}-{steps[-1]}) and is never "
                 f"freed: {origin(stacks, len(groups))}{runway(steps_to_oom, oom_step)}"),
        bytes=int(leaked["allocated_bytes"].sum()), bytes_per_step=int(rate), steps_to_oom=steps_to_oom,
        oom_step=oom_step, stacks=stacks, stack_count=len(groups),
        evidence=Evidence(
            event_index=[window[0].start_seq, levels[-1].start_seq],
            allocations=top_allocations(ctx.trace, leaked),
            details=LeakDetails(measured_steps=steps, levels=as_json(levels), level_growth_per_step=int(growth),
                                capacity_bytes=ctx.capacity_bytes, largest_step_peak_bytes=largest_peak),
        ),
    )]


def place(stack: LeakStack) -> str:
    """'train.py:88 forward (layers.3.mlp)': where a leaking group was allocated."""
    known = names_module(stack["module"]) and stack["module"] != stack["top_user_frame"]
    return stack["top_user_frame"] + (f" ({stack['module']})" if known else "")


def origin(stacks: list[LeakStack], stack_count: int) -> str:
    """'allocated at train.py:88 forward (layers.0.mlp) and 5 more places'."""
    more = stack_count - 1
    return f"allocated at {place(stacks[0])}" + (f" and {more} more place{'s' * (more > 1)}" if more else "")


def runway(steps_to_oom: int | None, oom_step: int | None) -> str:
    """'; out of memory in about 34 more steps at this rate (step 40)', or nothing when unknown or already out."""
    if not steps_to_oom:
        return ""
    return f"; out of memory in about {steps_to_oom} more steps at this rate (step {oom_step})"


def leaked_bytes_at(ctx: DeviceContext, seq: int, *, level_agreement: float = LEVEL_AGREEMENT,
                    min_share_of_peak: float = MIN_SHARE_OF_PEAK) -> int:
    """Leaked memory alive just after event `seq` (what leaks lives to the end once made)."""
    found = find(ctx, level_agreement=level_agreement, min_share_of_peak=min_share_of_peak)
    leaked = None if found is None else found.leaked
    return 0 if leaked is None else int(leaked.loc[leaked["seq_alloc"] <= seq, "allocated_bytes"].sum())


def _steps_to_oom(ctx: DeviceContext, rate: float) -> int | None:
    """Steps after the last recorded one until the peak reaches the device's capacity at this rate (0 when it
    already has); None when the capacity is unknown."""
    if ctx.capacity_bytes is None:
        return None
    if ctx.d.oom is not None:
        return 0
    return max(0, math.ceil((ctx.capacity_bytes - ctx.d.peak.allocated_bytes) / rate))
