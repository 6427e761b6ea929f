"""Activation-dominated peak: activations are the largest category at the peak."""
from __future__ import annotations

from analyzer.core.breakdown import split
from analyzer.core.module_tree import module_in_sentence
from analyzer.core.units import gib
from analyzer.core.vocabulary import Category, Phase, names_module
from analyzer.diagnose.context import DeviceContext
from analyzer.diagnose.evidence import top_allocations
from analyzer.result import ActivationPeakDetails, ActivationPeakFinding, Evidence


def detect(ctx: DeviceContext) -> list[ActivationPeakFinding]:
    d = ctx.d
    if not d.by_category or d.by_category[0]["name"] != Category.ACTIVATION:
        return []
    top = d.by_category[0]
    live = d.peak.live
    activations = live[live["category"] == Category.ACTIVATION]
    modules = [m for m in split(activations, "module", 5) if names_module(m["name"])]
    steps = [s["step"] for s in d.steps if s.get("phase") in (Phase.FORWARD, Phase.BACKWARD)]
    where = ", ".join(f"{module_in_sentence(m['name'])} {gib(m['bytes'])}" for m in modules[:3])
    return [ActivationPeakFinding(
        severity="warning", bytes=top["bytes"],
        summary=(f"Activations are {top['share']:.0%} of the peak ({gib(top['bytes'])} of "
                 f"{gib(d.peak.allocated_bytes)}){': largest in ' + where if where else ''}"),
        evidence=Evidence(time_us=[d.peak.time_us, d.peak.time_us], event_index=[d.peak.event_index] * 2,
                          allocations=top_allocations(ctx.trace, activations),
                          details=ActivationPeakDetails(share=top["share"], modules=modules, steps=steps)),
    )]
