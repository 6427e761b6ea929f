"""Optimizer spike: the optimizer step raises the peak. Separates the state the first step creates lazily
(persistent: Adam keeps two fp32 tensors per parameter) from per-step temporaries (foreach intermediates)."""
from __future__ import annotations

import re

import pandas as pd

from analyzer.core.breakdown import labels_at
from analyzer.core.units import gib
from analyzer.core.vocabulary import OPTIMIZER_STEP_PREFIX, Category, Phase
from analyzer.diagnose.context import DeviceContext
from analyzer.diagnose.evidence import top_allocations
from analyzer.diagnose.phase_peaks import phase_peak
from analyzer.result import Evidence, OptimizerSpikeDetails, OptimizerSpikeFinding

_OPTIMIZER_ANNOTATION = re.compile(rf"^{re.escape(OPTIMIZER_STEP_PREFIX)}(\w+)\.step$")
_OPTIMIZER_FRAME = re.compile(r"torch[\\/]optim[\\/](\w+)\.py$")


def optimizer_name(ctx: DeviceContext) -> str | None:
    """From `Optimizer.step#AdamW.step`, else from a torch/optim/<name>.py frame."""
    for name in ctx.trace.annotations["name"]:
        if m := _OPTIMIZER_ANNOTATION.match(name):
            return m.group(1)
    for frames in ctx.trace.stacks["frames"]:
        for filename, _, _ in frames:
            if (m := _OPTIMIZER_FRAME.search(filename)) and m.group(1) not in ("optimizer", "lr_scheduler"):
                return m.group(1)
    return None


def detect(ctx: DeviceContext) -> list[OptimizerSpikeFinding]:
    peak = phase_peak(ctx, Phase.OPTIMIZER, ignore=(Phase.CHECKPOINT_SAVE,))
    oom = ctx.d.oom
    oom_step, oom_phase = labels_at(ctx.labels, oom.event_index) if oom is not None else (None, None)
    oom_in_optimizer = oom_phase == Phase.OPTIMIZER
    if peak is None or (peak.bytes < peak.elsewhere and not oom_in_optimizer):
        return []
    live = ctx.live_at(peak.seq)
    in_optimizer = live[live["phase"] == Phase.OPTIMIZER]
    first_step = _first_optimizer_step(ctx.allocations)
    lazy = in_optimizer[(in_optimizer["category"] == Category.OPTIMIZER_STATE) & (in_optimizer["step"] == first_step)]
    temporaries = in_optimizer[in_optimizer["category"] == Category.TEMPORARY]
    name = optimizer_name(ctx) or "the optimizer"
    lazy_bytes, temp_bytes = int(lazy["allocated_bytes"].sum()), int(temporaries["allocated_bytes"].sum())
    parameters = ctx.category_bytes(Category.PARAMETER)
    raise_bytes = max(0, peak.bytes - peak.elsewhere)
    return [OptimizerSpikeFinding(
        severity="warning", bytes=raise_bytes, optimizer=name,
        lazy_state_bytes=lazy_bytes, temporary_bytes=temp_bytes, first_step=first_step,
        first_step_excess_bytes=_first_step_excess(ctx, first_step),
        oom_in_first_step=bool(oom_in_optimizer and oom_step == first_step),
        summary=(f"{name}.step raises the peak by {gib(raise_bytes)} (to {gib(peak.bytes)}; {gib(peak.elsewhere)} "
                    f"elsewhere): {gib(lazy_bytes)} of state created lazily at step {first_step} (persistent"
                    + (f", {lazy_bytes / parameters:.1f}x the parameters" if parameters else "")
                    + f") and {gib(temp_bytes)} of per-step temporaries"),
        evidence=Evidence(event_index=[peak.seq, peak.seq], allocations=top_allocations(ctx.trace, in_optimizer),
                          details=OptimizerSpikeDetails(optimizer_peak_bytes=peak.bytes, peak_elsewhere_bytes=peak.elsewhere,
                                                        lazy_state_bytes=lazy_bytes, temporary_bytes=temp_bytes,
                                                        parameter_bytes=parameters)),
    )]


def _first_step_excess(ctx: DeviceContext, first_step: int | None) -> int | None:
    """How much higher the first optimizer step peaks than the later ones (None: no later step recorded)."""
    events = ctx.timeline[ctx.timeline["seq"] >= 0]
    labels = ctx.labels.iloc[: len(events)]
    optimizer = (labels["phase"] == Phase.OPTIMIZER).to_numpy()
    if first_step is None or not optimizer.any():
        return None
    peaks = pd.Series(events["allocated_bytes"].to_numpy()[optimizer]).groupby(
        labels["step"].to_numpy()[optimizer]).max()
    later = peaks[peaks.index > first_step]
    return None if later.empty else max(0, int(peaks.get(first_step, 0) - later.max()))


def _first_optimizer_step(allocations: pd.DataFrame) -> int | None:
    steps = allocations.loc[allocations["phase"] == Phase.OPTIMIZER, "step"].dropna()
    return int(steps.min()) if len(steps) else None
