"""`analyze diff BEFORE AFTER`: did the change help, and did it help as much as the estimate said?

Peaks, breakdowns and findings side by side per device. The remedy being checked is `--remedy ID`, or else,
among BEFORE's remedies whose memory actually shrank (each acts on some categories: ZeRO-3 on the model
states, bf16 on activations; fixing a leak, on the leak: its finding is gone), the one whose estimate is closest
to the measured saving (said so in the output). When none of them shrank what it acts on, no remedy is credited.
"""
from __future__ import annotations

import argparse
import json
from typing import Any

from analyzer.result import Analysis, DeviceAnalysis
from analyzer.pipeline import analyze
from analyzer.commands.estimate import device_memory
from analyzer.diagnose.remedies import BY_ID, LAYOUT_ONLY
from analyzer.core.units import gib
from analyzer.core.vocabulary import FindingKind, RemedyId
from analyzer.errors import AnalyzerError, UnsupportedFormat

SHRANK = 0.05   # a category shrank when it lost at least this share of its bytes


def compare_device(before: DeviceAnalysis, after: DeviceAnalysis, remedy_id: str | None) -> dict[str, Any]:
    measured = (before.diagnosis.demand_bytes or before.peak.allocated_bytes) - (after.diagnosis.demand_bytes or after.peak.allocated_bytes)
    b_cat = {r["name"]: r["bytes"] for r in before.by_category}
    a_cat = {r["name"]: r["bytes"] for r in after.by_category}
    categories = {name: {"before": b_cat.get(name, 0), "after": a_cat.get(name, 0),
                         "change": (a_cat.get(name, 0) - b_cat.get(name, 0)) / b_cat[name] if b_cat.get(name) else None}
                  for name in sorted(set(b_cat) | set(a_cat))}
    leak_gone = _has_leak(before) and not _has_leak(after)   # fixing a leak shrinks no category of its own
    estimated = [r for r in before.diagnosis.remedies if r.get("saved_bytes") is not None
                 and (_shrank(r["id"], b_cat, a_cat) or (r["id"] == RemedyId.FIX_LEAK and leak_gone))]
    chosen, how = None, None
    layout = [r for r in before.diagnosis.remedies if r["id"] in LAYOUT_ONLY]
    if remedy_id:
        chosen, how = next((r for r in before.diagnosis.remedies if r["id"] == remedy_id), None), "given"
    elif layout and before.oom is not None and after.oom is None and abs(measured) < 0.01 * before.peak.allocated_bytes:
        chosen, how = layout[0], "the OOM is gone while the memory needed did not change: an allocator setting"
    elif estimated:
        chosen, how = min(estimated, key=lambda r: abs((r["saved_bytes"] or 0) - measured)), "closest estimate"
    check = None
    if chosen is not None and chosen.get("saved_bytes") is not None:
        check = {"remedy": chosen["id"], "chosen": how, "estimated_saving_bytes": chosen["saved_bytes"],
                 "measured_saving_bytes": measured,
                 "error": (measured - chosen["saved_bytes"]) / chosen["saved_bytes"] if chosen["saved_bytes"] else None}
    return {
        "device": before.device,
        "peak_before_bytes": before.peak.allocated_bytes, "peak_after_bytes": after.peak.allocated_bytes,
        "needed_before_bytes": before.diagnosis.demand_bytes, "needed_after_bytes": after.diagnosis.demand_bytes,
        "saving_bytes": measured, "by_category": categories,
        "findings_before": sorted({f["kind"] for f in before.diagnosis.findings}),
        "findings_after": sorted({f["kind"] for f in after.diagnosis.findings}),
        "oom_before": before.oom is not None, "oom_after": after.oom is not None, "remedy_check": check,
    }


def _has_leak(d: DeviceAnalysis) -> bool:
    return any(f["kind"] == FindingKind.LEAK for f in d.diagnosis.findings)


def _shrank(remedy_id: str, before: dict[str, int], after: dict[str, int]) -> bool:
    """Some category the remedy acts on lost at least SHRANK of its bytes between the runs."""
    remedy = BY_ID.get(remedy_id)
    acts_on = remedy.acts_on if remedy is not None else ()
    return any(before.get(c, 0) and after.get(c, 0) <= (1 - SHRANK) * before[c] for c in acts_on)


def compare(before: Analysis, after: Analysis, remedy_id: str | None = None) -> dict[str, Any]:
    pairs = [(b, next(a for a in after.devices if a.device == b.device)) for b in before.devices
             if any(a.device == b.device for a in after.devices)]
    return {"before": before.trace.source_path, "after": after.trace.source_path,
            "devices": [compare_device(b, a, remedy_id) for b, a in pairs]}


def render(result: dict[str, Any]) -> str:
    lines = [f"before: {result['before']}", f"after:  {result['after']}"]
    for d in result["devices"]:
        sign = "-" if d["saving_bytes"] >= 0 else "+"
        lines.append(f"\ncuda:{d['device']}: peak {sign}{gib(abs(d['saving_bytes']))} "
                     f"({gib(d['needed_before_bytes'])} -> {gib(d['needed_after_bytes'])})"
                     + (" ; the OOM is gone" if d["oom_before"] and not d["oom_after"] else ""))
        for name, c in d["by_category"].items():
            change = "" if c["change"] is None else f" ({c['change']:+.0%})"
            lines.append(f"  {name:<16} {gib(c['before']):>12} -> {gib(c['after']):>12}{change}")
        lines.append(f"  findings: {', '.join(d['findings_before']) or 'none'} -> {', '.join(d['findings_after']) or 'none'}")
        check = d["remedy_check"]
        if check is None and d["saving_bytes"]:
            lines.append("  no remedy of BEFORE shrank what it acts on: pass --remedy ID to check one")
        if check:
            error = "" if check["error"] is None else \
                f" (the measured saving is {1 + check['error']:.0%} of the estimated one)"
            lines.append(f"  estimate for {check['remedy']} ({check['chosen']}): -{gib(check['estimated_saving_bytes'])}; "
                         f"measured: -{gib(check['measured_saving_bytes'])}{error}")
    return "\n".join(lines)


class DiffCommand:
    description = __doc__

    def prepare_parser(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("before")
        parser.add_argument("after")
        parser.add_argument("--remedy", help="the remedy id applied between the runs (see `analyze FILE --format json`)")
        parser.add_argument("--gpu-memory", help="memory per GPU with its unit, e.g. 80GiB")
        parser.add_argument("--format", choices=("text", "json"), default="text")

    def run(self, args: argparse.Namespace) -> int:
        if args.remedy is not None and args.remedy not in BY_ID:
            raise AnalyzerError(None, f"--remedy {args.remedy}: no such remedy",
                                f"Use one of: {', '.join(BY_ID)}.")
        memory = device_memory(args.gpu_memory)
        result = compare(_one(args.before, memory), _one(args.after, memory), args.remedy)
        print(json.dumps(result, indent=2) if args.format == "json" else render(result))
        return 0


def _one(path: str, gpu_memory: int | None) -> Analysis:
    """The analysis of one recording (diff compares two runs, not two sets of ranks)."""
    analysis = analyze(path, gpu_memory)
    if not isinstance(analysis, Analysis):
        raise UnsupportedFormat(path, "analyze diff compares two recordings, and this is a set of ranks",
                                "Pass one rank's file from each run.")
    return analysis
