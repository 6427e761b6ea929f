"""The out-of-memory event: where it happened, and why.

Verdicts:
- fragmentation: the free device memory could not serve the request, but the allocator's own free cached
  blocks would have (together with it) and they are a meaningful share of what it reserved, while no single
  free block was large enough: the work fits, the memory layout does not (only where the input records the
  segments: a profiler trace's reserved total cannot show blocks);
- outside PyTorch: the device's capacity is known and much more of it is neither free nor reserved by
  PyTorch (NCCL buffers, cuBLAS/cuDNN workspaces, the CUDA context, other processes);
- capacity: the work does not fit.
"""
from __future__ import annotations

from analyzer.core.breakdown import labels_at
from analyzer.core.units import gib
from analyzer.core.vocabulary import names_module
from analyzer.diagnose.context import DeviceContext
from analyzer.diagnose.evidence import oom_where, top_allocations
from analyzer.diagnose.fragmentation import RECOVERY_THRESHOLD, fragmentation_at
from analyzer.result import Evidence, OomDetails, OomFinding

OUTSIDE_THRESHOLD = 0.10  # share of the device that must be outside PyTorch before we blame it


def detect(ctx: DeviceContext, *, outside_share: float = OUTSIDE_THRESHOLD,
           recovery_share: float = RECOVERY_THRESHOLD) -> list[OomFinding]:
    """The device's out-of-memory and its cause: outside PyTorch when more than `outside_share` of the device is
    neither free nor reserved by it; fragmentation when the cache (at least `recovery_share` of the reserve)
    would cover the request but no free block is large enough; else capacity."""
    oom = ctx.d.oom
    if oom is None:
        return []
    seq = oom.event_index
    picture = fragmentation_at(ctx, seq, oom.requested_bytes)
    step, phase = labels_at(ctx.labels, seq)
    live = ctx.live_at(seq)
    module = _module_at(ctx, seq)
    free = oom.device_free_bytes or 0
    cached = picture.inactive_bytes
    reserved = picture.reserved_bytes
    largest = picture.largest_free_block_bytes
    shortfall = oom.requested_bytes - free
    outside = None if ctx.capacity_bytes is None or ctx.capacity_source.startswith("reserved") else \
        ctx.capacity_bytes - free - reserved  # everything that is neither free nor PyTorch's, context included
    if outside is not None and ctx.capacity_bytes is not None and outside > outside_share * ctx.capacity_bytes:
        verdict, why = "outside_pytorch", (f"{gib(outside)} of the {gib(ctx.capacity_bytes)} device is neither free nor "
                                           "reserved by PyTorch (NCCL, cuBLAS/cuDNN workspaces, CUDA context, other "
                                           "processes)")
    elif shortfall > 0 and cached >= shortfall and cached >= recovery_share * reserved and \
            picture.segments_recorded and (largest is None or largest < oom.requested_bytes):
        verdict, why = "fragmentation", (f"{gib(free)} free on the device plus {gib(cached)} free in PyTorch's cache "
                                         f"would cover the {gib(oom.requested_bytes)} request, but the largest free "
                                         f"block is {gib(largest)}")
    else:
        verdict, why = "capacity", (f"{gib(picture.allocated_bytes)} allocated + {gib(oom.requested_bytes)} requested "
                                    f"exceeds the {gib(free + reserved)} PyTorch could use (free {gib(free)}, reserved "
                                    f"{gib(reserved)})")
    where = oom_where(phase, module, step)
    return [OomFinding(
        severity="critical", bytes=oom.requested_bytes, verdict=verdict, phase=phase, module=module, step=step,
        summary=f"Out of memory{' ' + where if where else ''}: {why}",
        evidence=Evidence(
            time_us=[oom.time_us, oom.time_us], event_index=[seq, seq],
            allocations=top_allocations(ctx.trace, live),
            details=OomDetails(requested_bytes=oom.requested_bytes, device_free_bytes=oom.device_free_bytes,
                               reserved_bytes=reserved, allocated_bytes=picture.allocated_bytes,
                               reserved_unallocated_bytes=cached, largest_free_block_bytes=largest,
                               outside_pytorch_bytes=outside, capacity_bytes=ctx.capacity_bytes,
                               capacity_source=ctx.capacity_source,
                               expandable_segments=picture.expandable_segments,
                               oom_top_user_frame=oom.top_user_frame),
        ),
    )]


def _module_at(ctx: DeviceContext, seq: int) -> str | None:
    """Module of the latest allocation made before the OOM (the failed request itself is not recorded)."""
    a = ctx.allocations
    before = a[a["seq_alloc"].notna() & (a["seq_alloc"] <= seq)]
    if before.empty:
        return None
    module = str(before.loc[before["seq_alloc"].idxmax(), "module"])
    return module if names_module(module) else None
