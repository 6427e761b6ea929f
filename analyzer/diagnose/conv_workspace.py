"""A large transient no tensor holds, in a memory timeline: most likely cuDNN's convolution workspace.

torch's memory profiler (export_memory_timeline) gives every tensor it follows a category; memory the
allocator hands to a library rather than to a tensor is its "unknown" category (unattributed here). When at
least UNKNOWN_SHARE of the peak is such memory and its largest block is made and freed within the recording (a
transient, not something kept), the usual owner in a training step is cuDNN: a convolution's workspace, and
with `torch.backends.cudnn.benchmark = True` the autotuner, which tries algorithms that ask for large
workspaces on the first steps. The recording has no op names, so the finding says "likely" and names its
evidence; its remedy turns the autotuner off (or caps the workspace).
"""
from __future__ import annotations

import pandas as pd

from analyzer.core.units import gib
from analyzer.core.vocabulary import UNATTRIBUTED, phase_in_sentence
from analyzer.diagnose.context import DeviceContext
from analyzer.result import ConvWorkspaceDetails, ConvWorkspaceFinding, Evidence

UNKNOWN_SHARE = 0.5   # torch's "unknown" memory at the peak from this share of it: worth naming its likely owner


def detect(ctx: DeviceContext, share: float = UNKNOWN_SHARE) -> list[ConvWorkspaceFinding]:
    """The finding, when `share` of the peak or more is a transient in torch's unknown category (only a recording
    whose rows carry torch's own categories says "unknown": an export_memory_timeline file)."""
    if not ctx.trace.records_categories:
        return []
    live = ctx.d.peak.live
    unknown = live[live["category"] == UNATTRIBUTED]
    total, peak = int(unknown["allocated_bytes"].sum()), ctx.d.peak.allocated_bytes
    if not peak or total < share * peak:
        return []
    largest = unknown.loc[unknown["allocated_bytes"].idxmax()]
    if pd.isna(largest["t_free_us"]) or pd.isna(largest["t_alloc_us"]):   # kept to the end, or from before
        return []
    when = f" in {phase_in_sentence(ctx.d.peak_phase)}" if ctx.d.peak_phase and ctx.d.peak_phase != UNATTRIBUTED else ""
    lived_ms = (int(largest["t_free_us"]) - int(largest["t_alloc_us"])) / 1000
    return [ConvWorkspaceFinding(
        severity="warning", bytes=total,
        summary=(f"{gib(total)} of the {gib(peak)} peak ({total / peak:.0%}) is memory no tensor holds (torch's "
                    f"'unknown' category), made and freed{when} ({gib(int(largest['allocated_bytes']))} lived "
                    f"{lived_ms:.1f} ms): most likely cuDNN's convolution workspace, large when its autotuner "
                    "(torch.backends.cudnn.benchmark = True) tries algorithms"),
        evidence=Evidence(time_us=[ctx.d.peak.time_us, ctx.d.peak.time_us], event_index=[ctx.d.peak.event_index] * 2,
                          details=ConvWorkspaceDetails(unknown_bytes=total, share=total / peak,
                                                       largest_bytes=int(largest["allocated_bytes"]),
                                                       lived_us=int(lived_ms * 1000))),
    )]
