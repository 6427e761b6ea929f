"""`analyze diff BEFORE AFTER`: did the change help, and did it help as much as the estimate said?

Peaks, breakdowns and findings side by side per device. A remedy is credited only when the change it names is
visible in the pair (each acts on some categories: ZeRO-3 on the model states, bf16 on activations; fixing a
leak, on the leak: its finding is gone) and the memory needed went down: the one given (`--remedy NAME`, an id
or a short name), or else, among BEFORE's remedies, the one whose estimate is closest to the measured saving.
Otherwise the output says that no remedy explains the change, and what changed most. `compare` is the logic,
`render` the terminal's text.
"""
from __future__ import annotations

import argparse
import json
from typing import Any

from analyzer.commands.estimate import device_memory
from analyzer.core.printable import printable
from analyzer.core.units import format_bytes
from analyzer.core.vocabulary import RemedyId
from analyzer.diagnose.remedies import BY_ID, LAYOUT_ONLY
from analyzer.diagnose.remedy_names import remedy_help, resolve_remedy
from analyzer.errors import UnsupportedFormat
from analyzer.pipeline import analyze
from analyzer.result import Analysis, DeviceAnalysis, LeakFinding, ListedRemedy, first_of

SHRANK = 0.05   # a category shrank when it lost at least this share of its bytes
UNCHANGED = 0.01  # of the memory needed before: an allocator setting leaves the need this close to what it was
CHANGES_SAID = 3  # categories named when no remedy explains the change


def compare_device(before: DeviceAnalysis, after: DeviceAnalysis, remedy_id: str | None) -> dict[str, Any]:
    """One device of two runs: the memory needed by each, each category's change, and the remedy that explains
    the change (`remedy_check`), or why none does (`unexplained`). A remedy is credited only when the change it
    names is visible in the pair (what it acts on shrank, the leak is gone, the OOM went while the need stayed)
    and the memory needed went down (an allocator setting: the OOM went)."""
    needed_before = before.diagnosis.demand_bytes or before.peak.allocated_bytes
    needed_after = after.diagnosis.demand_bytes or after.peak.allocated_bytes
    measured = needed_before - needed_after
    b_cat = {r["name"]: r["bytes"] for r in before.by_category}
    a_cat = {r["name"]: r["bytes"] for r in after.by_category}
    categories = {name: {"before": b_cat.get(name, 0), "after": a_cat.get(name, 0),
                         "change": (a_cat.get(name, 0) - b_cat.get(name, 0)) / b_cat[name] if b_cat.get(name) else None}
                  for name in sorted(set(b_cat) | set(a_cat))}
    oom_gone = before.oom is not None and after.oom is None
    leak_gone = _has_leak(before) and not _has_leak(after)   # fixing a leak shrinks no category of its own
    layout_fix = oom_gone and abs(measured) < UNCHANGED * needed_before

    def explains(rid: str) -> bool:
        if rid in LAYOUT_ONLY:
            return layout_fix
        seen = leak_gone if rid == RemedyId.FIX_LEAK else _shrank(rid, b_cat, a_cat)
        return seen and measured > 0

    listed = {r["id"]: r for r in before.diagnosis.remedies}
    chosen: str | None = None
    how = None
    if remedy_id:
        chosen, how = (remedy_id, "given") if explains(remedy_id) else (None, None)
    else:
        credited = [r for r in before.diagnosis.remedies if explains(r["id"])]
        layout = [r for r in credited if r["id"] in LAYOUT_ONLY]
        estimated = [r for r in credited if r.get("saved_bytes") is not None and r["id"] not in LAYOUT_ONLY]
        if layout:
            chosen, how = layout[0]["id"], "the OOM is gone while the memory needed did not change: an allocator setting"
        elif estimated:
            chosen = min(estimated, key=lambda r: abs((r["saved_bytes"] or 0) - measured))["id"]
            how = "closest estimate"
    check = None
    if chosen is not None:
        estimate = listed[chosen].get("saved_bytes") if chosen in listed else None
        check = {"remedy": chosen, "chosen": how, "estimated_saving_bytes": estimate, "measured_saving_bytes": measured,
                 "error": (measured - estimate) / estimate if estimate else None}
    return {
        "device": before.device,
        "peak_before_bytes": before.peak.allocated_bytes, "peak_after_bytes": after.peak.allocated_bytes,
        "needed_before_bytes": needed_before, "needed_after_bytes": needed_after,
        "saving_bytes": measured, "by_category": categories,
        "findings_before": sorted({f.kind.value for f in before.diagnosis.findings}),
        "findings_after": sorted({f.kind.value for f in after.diagnosis.findings}),
        "oom_before": before.oom is not None, "oom_after": after.oom is not None, "remedy_check": check,
        "unexplained": None if check else _unexplained(remedy_id, measured, categories, leak_gone, listed),
    }


def _unexplained(remedy_id: str | None, measured: int, categories: dict[str, dict[str, Any]], leak_gone: bool,
                 listed: dict[str, ListedRemedy]) -> dict[str, Any]:
    """Why no remedy explains the change, and what did change (the categories that moved most, in bytes)."""
    moved = sorted(((name, c["after"] - c["before"]) for name, c in categories.items() if c["after"] != c["before"]),
                   key=lambda nc: (-abs(nc[1]), nc[0]))[:CHANGES_SAID]
    if measured <= 0:
        reason = f"the memory needed went {'up' if measured else 'neither up nor down'}"
    elif remedy_id is None:
        reason = "no remedy of BEFORE shrank what it acts on" if listed else "BEFORE lists no remedy"
    elif remedy_id in LAYOUT_ONLY:
        reason = f"{remedy_id} leaves the memory needed as it was, and it went down"
    elif remedy_id == RemedyId.FIX_LEAK:
        reason = "the leak is still there" if not leak_gone else "the memory needed did not go down"
    else:
        reason = f"{' or '.join(BY_ID[remedy_id].acts_on)}, what {remedy_id} shrinks, did not shrink"
    return {"reason": reason, "changes": [{"category": name, "change_bytes": change} for name, change in moved]}


def _has_leak(d: DeviceAnalysis) -> bool:
    return first_of(d.diagnosis.findings, LeakFinding) is not None


def _shrank(remedy_id: str, before: dict[str, int], after: dict[str, int]) -> bool:
    """Some category the remedy acts on lost at least SHRANK of its bytes between the runs."""
    remedy = BY_ID.get(remedy_id)
    acts_on = remedy.acts_on if remedy is not None else ()
    return any(before.get(c, 0) and after.get(c, 0) <= (1 - SHRANK) * before[c] for c in acts_on)


def compare(before: Analysis, after: Analysis, remedy_id: str | None = None) -> dict[str, Any]:
    """Every device the two runs share, compared (compare_device); `remedy_id` an id (resolve_remedy)."""
    pairs = [(b, next(a for a in after.devices if a.device == b.device)) for b in before.devices
             if any(a.device == b.device for a in after.devices)]
    return {"before": before.trace.source_path, "after": after.trace.source_path,
            "devices": [compare_device(b, a, remedy_id) for b, a in pairs]}


def _signed(n: int) -> str:
    return ("+" if n > 0 else "") + format_bytes(n)


def render(result: dict[str, Any]) -> str:
    """The comparison for a terminal: each size in the unit it fills, each change signed."""
    lines = [f"before: {printable(result['before'])}", f"after:  {printable(result['after'])}"]
    for d in result["devices"]:
        before, after = d["needed_before_bytes"], d["needed_after_bytes"]
        share = f", {(after - before) / before:+.0%}" if before else ""
        lines.append(f"\ncuda:{d['device']}: memory needed {format_bytes(before)} -> {format_bytes(after)} "
                     f"({_signed(after - before)}{share})"
                     + ("; the OOM is gone" if d["oom_before"] and not d["oom_after"] else "")
                     + ("; it ran out of memory" if d["oom_after"] and not d["oom_before"] else ""))
        lines.append(f"  {'category':<16} {'before':>11} {'after':>11}  change")
        for name, c in d["by_category"].items():
            change = "" if c["change"] is None else f" ({c['change']:+.0%})"
            moved = f"{_signed(c['after'] - c['before'])}{change}" if c["after"] != c["before"] else "same"
            lines.append(f"  {name:<16} {format_bytes(c['before']):>11} {format_bytes(c['after']):>11}  {moved}")
        lines.append(f"  findings: {', '.join(d['findings_before']) or 'none'} -> {', '.join(d['findings_after']) or 'none'}")
        check, unexplained = d["remedy_check"], d["unexplained"]
        if check:
            estimated = check["estimated_saving_bytes"]
            said = (f"estimated {format_bytes(estimated)}, measured {format_bytes(check['measured_saving_bytes'])}"
                    + ("" if check["error"] is None else f" ({1 + check['error']:.0%} of the estimate)")
                    if estimated is not None else
                    f"measured {format_bytes(check['measured_saving_bytes'])} (BEFORE gave no estimate for it)")
            lines.append(f"  {check['remedy']} explains it ({check['chosen']}): saving {said}")
        elif unexplained:
            changes = ", ".join(f"{c['category']} {_signed(c['change_bytes'])}" for c in unexplained["changes"])
            lines.append(f"  no remedy explains this change: {unexplained['reason']}"
                         + (f"; what changed most: {changes}" if changes else ""))
    return "\n".join(lines)


class DiffCommand:
    description = __doc__

    def prepare_parser(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("before")
        parser.add_argument("after")
        parser.add_argument("--remedy", metavar="NAME", help="the remedy applied between the runs: " + remedy_help())
        parser.add_argument("--gpu-memory", help="memory per GPU with its unit, e.g. 80GiB")
        parser.add_argument("--format", choices=("text", "json"), default="text")

    def run(self, args: argparse.Namespace) -> int:
        remedy = resolve_remedy(args.remedy) if args.remedy is not None else None
        memory = device_memory(args.gpu_memory)
        result = compare(_one(args.before, memory), _one(args.after, memory), remedy)
        print(json.dumps(result, indent=2) if args.format == "json" else render(result))
        return 0


def _one(path: str, gpu_memory: int | None) -> Analysis:
    """The analysis of one recording (diff compares two runs, not two sets of ranks)."""
    analysis = analyze(path, gpu_memory)
    if not isinstance(analysis, Analysis):
        raise UnsupportedFormat(path, "analyze diff compares two recordings, and this is a set of ranks",
                                "Pass one rank's file from each run.")
    return analysis
