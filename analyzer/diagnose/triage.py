"""Triage: what kind of memory problem a run has, decided before any remedy, in the order an expert checks.

1. outside_pytorch: memory PyTorch does not own (an OOM whose verdict says so, or an `outside_pytorch`
   finding from a source that shows the device's usage): no change to the training code helps until it is found;
2. leak: memory grows across steps (a `leak` finding): a smaller batch only delays the out of memory;
3. phase_spike: one phase raises the peak above the rest of the step (the first optimizer step, a checkpoint
   save): that phase is what to fix (of two, the one where the run peaked or ran out);
4. steady_state: none of these; what every step needs is what has to shrink.
"""
from __future__ import annotations

from analyzer.core.vocabulary import FindingKind, Phase
from analyzer.diagnose.context import DeviceContext
from analyzer.diagnose.step_levels import MIN_MEASURED_STEPS, measured
from analyzer.result import Details, Finding, OomFinding, OutsidePytorchFinding, Triage, first_of

PHASE_SPIKES: dict[FindingKind, Phase] = {FindingKind.OPTIMIZER_SPIKE: Phase.OPTIMIZER, FindingKind.CHECKPOINT_GATHER: Phase.CHECKPOINT_SAVE}  # finding -> its phase


def triage(ctx: DeviceContext, findings: list[Finding[Details]]) -> Triage:
    """{"verdict": outside_pytorch | leak | phase_spike | steady_state, "reason": one sentence}."""
    first: dict[FindingKind, Finding[Details]] = {}
    for f in findings:
        first.setdefault(f.kind, f)
    oom = first_of(findings, OomFinding)
    measured = first_of(findings, OutsidePytorchFinding)
    outside: Finding[Details] | None = oom if oom is not None and oom.verdict == "outside_pytorch" else \
        (measured if measured is not None and measured.significant else None)
    if outside is not None:
        return {"verdict": "outside_pytorch", "reason": outside.summary}
    if FindingKind.LEAK in first:
        return {"verdict": "leak", "reason": f"{first[FindingKind.LEAK].summary}; a smaller batch only delays the out of memory"}
    spikes = [first[k] for k in PHASE_SPIKES if k in first]
    if spikes:
        worst_phase = oom.phase if oom is not None else ctx.d.peak_phase
        spike = next((f for f in spikes if PHASE_SPIKES[f.kind] == worst_phase), spikes[0])
        return {"verdict": "phase_spike", "reason": spike.summary}
    return {"verdict": "steady_state", "reason": _steady_reason(ctx, oom)}


def _steady_reason(ctx: DeviceContext, oom: OomFinding | None) -> str:
    levels = ctx.step_levels
    count = f"{len(levels)} training step{'s' if len(levels) != 1 else ''} recorded"
    growth = (f"memory does not grow across steps {levels[1].step}-{levels[-1].step}" if measured(levels) else
              f"growth across steps cannot be measured ({count}; {MIN_MEASURED_STEPS + 2} or more are needed)")
    what = oom.summary if oom is not None else "the peak is what each step needs"
    return f"No sign of memory outside PyTorch, {growth} and no phase spikes above the rest of the step: {what}"
