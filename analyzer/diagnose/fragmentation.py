"""Fragmentation: reserved memory that holds no tensor, measured where it can hurt, at the peak and at the OOM.

- internal: allocated − requested (the allocator's rounding inside blocks);
- external (fragmentation): free bytes inside segments that also hold live blocks (unusable for a larger request);
- cache: whole free segments the allocator keeps (released and retried before an OOM is declared, so cache
  is never what makes a run fail, and it is reported as cache, not as fragmentation);
- largest free block: the biggest gap between live blocks of any segment, what a request can get without
  new cudaMalloc memory.
Expandable segments map and unmap pages on demand, so their free space is not split into fixed blocks.

Only a snapshot records segments. A profiler trace or a memory timeline records the reserved total: there
the picture is reserved − allocated and nothing else (`None`: not recorded).

A warning is given only when fragmentation caused the OOM (the oom detector's verdict) or nearly caused one:
at the peak, what was reserved reached NEAR_OOM_SHARE of the device's memory while the free pieces inside
used segments were at least RECOVERY_THRESHOLD of it.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pandas as pd

from analyzer.core.units import gib
from analyzer.diagnose.context import DeviceContext
from analyzer.result import (
    Evidence,
    FragmentationDetails,
    FragmentationFinding,
    FragmentationPicture,
    FreeInSegment,
    SegmentsAt,
)

OOMS_PICTURED = 4          # the HTML report's allocator pictures: the peak and the last OOMs
SEGMENTS_PICTURED = 40     # segments drawn per picture (those with the largest free blocks)
RECOVERY_THRESHOLD = 0.05  # free memory worth reporting: at least this share of what is reserved
NEAR_OOM_SHARE = 0.95      # reserved at the peak above this share of the device: an OOM nearly happened


def segments_at(ctx: DeviceContext, seq: int) -> pd.DataFrame:
    """Segments alive just after event `seq`, each with used bytes, free bytes and its largest free gap."""
    s = ctx.trace.segments
    s = s[(s["device"] == ctx.device)]
    born = s["seq_alloc"].isna() & (s["alive_at_end"] | s["seq_free"].notna()) | (s["seq_alloc"] <= seq)
    alive = s["seq_free"].isna() & s["alive_at_end"] | (s["seq_free"] > seq)
    segments = s[(born & alive).fillna(False).astype(bool)].sort_values("addr").reset_index(drop=True)
    live = ctx.live_at(seq)[["addr", "allocated_bytes"]].sort_values("addr")
    segments["end"] = segments["addr"] + segments["bytes"]
    if segments.empty:
        return segments.assign(used_bytes=0, free_bytes=0, largest_free_bytes=0)
    owner = np.searchsorted(segments["addr"].to_numpy(), live["addr"].to_numpy(), side="right") - 1
    inside = (owner >= 0) & (live["addr"].to_numpy() < segments["end"].to_numpy()[np.maximum(owner, 0)])
    blocks = live[inside].assign(segment=owner[inside])
    used = blocks.groupby("segment")["allocated_bytes"].sum()
    segments["used_bytes"] = segments.index.map(used).fillna(0).astype(np.int64)
    segments["free_bytes"] = (segments["bytes"] - segments["used_bytes"]).clip(lower=0)
    segments["largest_free_bytes"] = _largest_gaps(segments, blocks)
    return segments


def _largest_gaps(segments: pd.DataFrame, blocks: pd.DataFrame) -> np.ndarray:
    """Per segment, the largest gap between its live blocks (or its edges): each block contributes the gap
    before it, and each segment the gap after its last block (blocks come sorted by address)."""
    seg = blocks["segment"].to_numpy()
    starts = blocks["addr"].to_numpy()
    ends = starts + blocks["allocated_bytes"].to_numpy()
    first_in_segment = np.r_[True, seg[1:] != seg[:-1]] if len(seg) else np.zeros(0, dtype=bool)
    previous_end = np.where(first_in_segment, segments["addr"].to_numpy()[seg] if len(seg) else 0, np.r_[0, ends[:-1]])
    largest = np.zeros(len(segments), dtype=np.int64)
    np.maximum.at(largest, seg, starts - previous_end)
    last_end = segments["addr"].to_numpy().copy()  # an empty segment is one gap from its start to its end
    np.maximum.at(last_end, seg, ends)
    return np.maximum(largest, segments["end"].to_numpy() - last_end)


def segments_recorded(ctx: DeviceContext) -> bool:
    """The input records the allocator's segments (a snapshot), not only its reserved total."""
    return ctx.trace.has_segments


def fragmentation_at(ctx: DeviceContext, seq: int, request: int | None = None) -> FragmentationPicture:
    """The fragmentation picture just after event `seq` (the peak, or the OOM); what the input does not
    record (segments, blocks) is None. Measured once per moment (the oom detector, this one and the diagnosis
    ask for it)."""
    return ctx.memo(("fragmentation", seq, request), lambda: _picture(ctx, seq, request))


def _picture(ctx: DeviceContext, seq: int, request: int | None) -> FragmentationPicture:
    row = ctx.at(seq)
    live = ctx.live_at(seq)
    totals = FragmentationPicture(
        event_index=int(seq),
        reserved_bytes=int(row["reserved_bytes"]),
        allocated_bytes=int(row["allocated_bytes"]),
        inactive_bytes=int(row["reserved_bytes"] - row["allocated_bytes"]),
        internal_bytes=int((live["allocated_bytes"] - live["requested_bytes"]).sum()),
        external_bytes=None, cached_free_segments_bytes=None, largest_free_block_bytes=None,
        request_bytes=request,
        expandable_segments=ctx.expandable_segments(),
        segments_recorded=segments_recorded(ctx),
    )
    if not totals.segments_recorded:
        return totals
    segments = segments_at(ctx, seq)
    partly_used = segments["used_bytes"] > 0
    expandable = bool(segments["expandable"].any()) if len(segments) else False
    return replace(
        totals,
        external_bytes=int(segments.loc[partly_used, "free_bytes"].sum()),
        cached_free_segments_bytes=int(segments.loc[~partly_used, "free_bytes"].sum()),
        largest_free_block_bytes=None if expandable else int(segments["largest_free_bytes"].max() if len(segments) else 0),
        segments=[FreeInSegment(int(r.addr), int(r.bytes), int(r.used_bytes), int(r.free_bytes), int(r.largest_free_bytes))
                  for r in segments.sort_values("free_bytes", ascending=False, kind="stable").head(50).itertuples()],
    )


def segments_pictured(ctx: DeviceContext) -> list[SegmentsAt] | None:
    """The segments and their live blocks at the peak and at the last OOMS_PICTURED OOMs, for the report to draw;
    None where the input records no segments (a profiler trace or a memory timeline records only totals)."""
    if not ctx.trace.has_segments or not ctx.d.trace_entries:
        return None
    ooms = ctx.trace.ooms[ctx.trace.ooms["device"] == ctx.device].tail(OOMS_PICTURED)
    moments: list[tuple[str, int, int | None]] = [("at the peak", ctx.d.peak.event_index, None)]
    moments += [(f"at the out-of-memory (event {int(o.seq)})", int(o.seq), int(o.requested_bytes))
                for o in ooms.itertuples()]
    return [_segments_at(ctx, title, seq, request) for title, seq, request in moments]


def _segments_at(ctx: DeviceContext, title: str, seq: int, request: int | None) -> SegmentsAt:
    segments = segments_at(ctx, seq)
    drawn = segments.sort_values(["largest_free_bytes", "bytes"], ascending=False).head(SEGMENTS_PICTURED)
    live = ctx.live_at(seq).sort_values("addr")[["addr", "allocated_bytes", "requested_bytes"]]
    return SegmentsAt(title=title, measured=fragmentation_at(ctx, seq, request), segment_count=len(segments),
                      segments=drawn[["addr", "end", "bytes", "used_bytes", "free_bytes", "largest_free_bytes"]],
                      live=live.reset_index(drop=True))


def nearly_out_of_memory(picture: FragmentationPicture, capacity: int | None, near_oom_share: float = NEAR_OOM_SHARE,
                         recovery_share: float = RECOVERY_THRESHOLD) -> bool:
    """Fragmentation nearly caused an OOM: the reserve reached `near_oom_share` of the device while the free
    pieces inside used segments were `recovery_share` of it or more (cache alone never is: it is released first)."""
    reserved, fragmented = picture.reserved_bytes, picture.external_bytes
    return (capacity is not None and fragmented is not None and reserved >= near_oom_share * capacity
            and fragmented >= recovery_share * reserved)


def detect(ctx: DeviceContext, *, near_oom_share: float = NEAR_OOM_SHARE,
           recovery_share: float = RECOVERY_THRESHOLD) -> list[FragmentationFinding]:
    """Fragmentation at the allocated peak, warned about only when it nearly caused an OOM (an OOM it caused is
    the oom detector's verdict): `nearly_out_of_memory`."""
    seq = ctx.d.peak.event_index
    picture = fragmentation_at(ctx, seq)
    if ctx.d.oom is not None or not nearly_out_of_memory(picture, ctx.capacity_bytes, near_oom_share, recovery_share):
        return []
    reserved, fragmented = picture.reserved_bytes, picture.external_bytes
    assert ctx.capacity_bytes is not None and fragmented is not None  # nearly_out_of_memory needs them
    largest = picture.largest_free_block_bytes
    return [FragmentationFinding(
        severity="warning", bytes=fragmented,
        summary=(f"At the peak {gib(reserved)} of the {gib(ctx.capacity_bytes)} device was reserved, "
                    f"{gib(fragmented)} of it free in pieces inside used segments"
                    + ("" if largest is None else f" (the largest {gib(largest)})")
                    + f": a request larger than the largest piece would have failed; "
                      f"{gib(picture.cached_free_segments_bytes or 0)} more was cache (whole free segments)"),
        evidence=Evidence(event_index=[seq, seq], details=FragmentationDetails(picture)),
        recoverable_bytes=fragmented,
    )]
