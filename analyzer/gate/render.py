"""A check told in words: one headline per device, the lines that say what grew or what is over, the same as a
Markdown summary, and as JSON for CI systems other than GitHub's (github.py lays the words out as annotations).

Every name taken from an input (a module, an allocation site, a path, a finding) goes through `printable` here,
or `md_text` in Markdown, before it is shown.
"""
from __future__ import annotations

from dataclasses import asdict
from typing import Any

from analyzer.core.printable import printable
from analyzer.core.units import format_bytes
from analyzer.core.vocabulary import category_plural, phase_noun
from analyzer.gate.compare import Cause, Change, Check, DeviceCheck, Likely

CHECK_SCHEMA = "analyzer-check/1"


def _where(d: DeviceCheck) -> str:
    """', peak at step 6 in backward' (and where the baseline's was, when it is known and elsewhere)."""
    now, then = d.now, d.then
    parts = []
    if now.step is not None:
        parts.append(f"step {now.step}")
    noun = phase_noun(now.phase)
    if noun is not None:
        parts.append(f"in {noun}")
    if not parts:
        return ""
    was = f" (the baseline's at step {then.step})" if then is not None and then.step is not None \
        and then.step != now.step else ""
    return ", peak at " + " ".join(parts) + was


def headline(d: DeviceCheck, check: Check) -> str:
    """One sentence: the device, whether it holds, what it needs against what it may."""
    now, label = d.now, d.now.label
    needed = f"needs {format_bytes(now.needed_bytes)}" + (" (at the OOM)" if now.oom else "")
    if check.budget_bytes is not None:
        if d.holds:
            return f"{label} holds its budget: {needed} of {format_bytes(check.budget_bytes)}"
        return f"{label} is over its budget: {needed}, the budget is {format_bytes(check.budget_bytes)} " \
               f"({format_bytes(d.over_bytes)} over){_where(d)}"
    if d.then is None:
        return f"{label} has no baseline: {needed}, not checked"
    was = d.then.needed_bytes
    growth = f"{(now.needed_bytes - was) / was:+.1%}" if was else "from nothing"
    tolerance = f"tolerance {check.tolerance:.0%}: at most {format_bytes(d.limit_bytes)}"
    if d.holds:
        stale = "; it needs more than the tolerance less: write a new baseline" if d.stale else ""
        return f"{label} holds its baseline: {needed}, was {format_bytes(was)} ({growth}; {tolerance}){stale}"
    return f"{label} grew past its baseline: {needed}, was {format_bytes(was)} ({growth}; {tolerance}){_where(d)}"


def _change(c: Change) -> str:
    name = printable(c.name)
    if c.before is None:
        return f"{name} {format_bytes(c.after)}"
    if c.new:
        return f"{name} new, {format_bytes(c.after)}"
    return f"{name} +{format_bytes(c.delta)} ({format_bytes(c.before)} -> {format_bytes(c.after)})"


def _listed(changes: tuple[Change, ...], plural: bool = False) -> str:
    return ", ".join(_change(c) if not plural else _change(Change(category_plural(c.name), c.before, c.after))
                     for c in changes)


def details(d: DeviceCheck, check: Check) -> list[str]:
    """What grew (against a baseline) or what the peak is made of (over a budget), where, and what to do."""
    if d.holds:
        return []
    compared = d.then is not None and bool(d.then.by_category)   # golden values have no breakdown to compare
    lines = []
    if d.categories:
        lines.append(("grew most: " if compared else "at the peak: ") + _listed(d.categories, plural=True))
    if d.phases:
        lines.append("phases: " + ", ".join(_change(Change(phase_noun(c.name) or c.name, c.before, c.after))
                                            for c in d.phases))
    if d.modules:
        lines.append("modules: " + _listed(d.modules))
    if d.sites:
        lines.append(("allocation sites new or larger: " if compared else "largest allocation sites: ")
                     + _listed(d.sites))
    if d.then is not None and not compared:
        kind = check.baseline_kind.value if check.baseline_kind else ""
        lines.append(f"the baseline ({kind}) has the peak but not its breakdowns: the split above is the run's own")
    if d.likely:
        lines.append("likely change: " + "; ".join(_likely(x) for x in d.likely))
    if d.new_findings:
        lines.append("new findings: " + ", ".join(printable(f) for f in d.new_findings))
    if d.first_step_over is not None:
        step = d.first_step_over
        against = f"; the baseline's was {format_bytes(d.baseline_at_step)}" if d.baseline_at_step is not None else ""
        past = "the budget" if check.budget_bytes is not None else "the baseline"
        lines.append(f"first step past {past}: step {step.step} (running peak {format_bytes(step.bytes)}{against})")
    if check.budget_bytes is not None:
        lines.append(fix_line(d))
    return lines


def _likely(x: Likely) -> str:
    if x.cause is Cause.LEAK:
        return "a leak (memory kept from every step: see the leak finding of analyze RUN)"
    if x.cause is Cause.MODEL:
        new = f", new modules {', '.join(printable(n) for n in x.evidence[:3])}" if x.evidence else ""
        more = f" and {len(x.evidence) - 3} more" if len(x.evidence) > 3 else ""
        return f"a larger model (parameters x{x.ratio:.2f}{new}{more})"
    if x.cause is Cause.SEQUENCE:
        return f"a longer sequence (inputs x{x.ratio:.2f}, and {printable(x.evidence[0])} x{x.evidence_ratio:.2f}, " \
               "as their square: attention scores)"
    return f"a larger batch (inputs x{x.ratio:.2f}, the step's memory in proportion)"


def fix_line(d: DeviceCheck) -> str:
    fix = d.fix
    if fix is None:
        unsized = [r for r in d.now.remedies if r.new_peak_bytes is None]   # a log's: it cannot size them
        if d.now.oom and unsized:
            return f"what the OOM's numbers point to first: {printable(unsized[0].title)} (analyze RUN says why)"
        return "no remedy the analysis knows brings it under the budget (see analyze RUN for the options)"
    if len(fix.steps) == 1:
        return f"cheapest fix that brings it under: {printable(fix.steps[0].title)} " \
               f"(predicted peak {format_bytes(fix.predicted_bytes)})"
    made = "; ".join(f"{n}. {printable(s.title)}" for n, s in enumerate(fix.steps, 1))
    return f"cheapest fix that brings it under ({len(fix.steps)} changes): {made} " \
           f"(predicted peak {format_bytes(fix.predicted_bytes)})"


def render_text(check: Check) -> str:
    against = f"budget {format_bytes(check.budget_bytes)}" if check.budget_bytes is not None else \
        f"baseline {printable(check.baseline or '')}"
    lines = [f"{printable(check.run)} against {against}: {'holds' if check.holds else 'FAILS'}"]
    for d in check.devices:
        lines.append(headline(d, check))
        lines += [f"  {line}" for line in details(d, check)]
    lines += [f"warning: {printable(w)}" for w in check.warnings]
    return "\n".join(lines)


def check_document(check: Check) -> dict[str, Any]:
    """The JSON of a check: its verdict and exit code, and every device's numbers and sentences."""
    return {"schema": CHECK_SCHEMA, "holds": check.holds, "exit_code": check.exit_code, "run": check.run,
            "budget_bytes": check.budget_bytes, "baseline": check.baseline, "baseline_kind": check.baseline_kind and check.baseline_kind.value,
            "tolerance": check.tolerance, "warnings": list(check.warnings),
            "devices": [{"device": d.now.device, "rank": d.now.rank, "holds": d.holds, "stale": d.stale,
                         "needed_bytes": d.now.needed_bytes, "limit_bytes": d.limit_bytes,
                         "baseline_bytes": None if d.then is None else d.then.needed_bytes,
                         "peak": {"step": d.now.step, "phase": d.now.phase, "module": d.now.module},
                         "categories": [asdict(c) for c in d.categories], "phases": [asdict(c) for c in d.phases],
                         "modules": [asdict(c) for c in d.modules], "sites": [asdict(c) for c in d.sites],
                         "new_findings": list(d.new_findings), "likely": [asdict(x) for x in d.likely],
                         "first_step_over": None if d.first_step_over is None else asdict(d.first_step_over),
                         "baseline_at_step": d.baseline_at_step,
                         "fix": None if d.fix is None else asdict(d.fix),
                         "headline": headline(d, check), "details": details(d, check)}
                        for d in check.devices]}
