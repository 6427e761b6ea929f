"""Reserved growth: the memory PyTorch reserves keeps growing from step to step while what the steps allocate
does not. The caching allocator keeps segments it cannot reuse (blocks split for one size, cached for a size
that never comes back); no tensor leaks, so the fix is the allocator's configuration, not the code.

How: at each measured step start (see `step_levels`), the reserve beyond the highest allocation so far is what
the cache holds for nothing the run ever needed at once; when that excess grows in at least two measured steps
and in at least half of them, by at least 0.5% of the reserved peak a step, while what is alive at the step
starts besides the model states grows by less than that, it is reported. A leak pins blocks inside segments
and grows the reserve too; that is the leak's growth, reported by the leak detector, not this one.
"""
from __future__ import annotations

import math

import numpy as np

from analyzer.core.units import rate_bytes
from analyzer.diagnose.context import DeviceContext
from analyzer.diagnose.step_levels import MIN_MEASURED_STEPS, as_json, measured
from analyzer.result import Evidence, ReservedGrowthDetails, ReservedGrowthFinding

MIN_SHARE_OF_RESERVED = 0.005   # growth per step below this share of the reserved peak is noise


def detect(ctx: DeviceContext, *, min_share: float = MIN_SHARE_OF_RESERVED) -> list[ReservedGrowthFinding]:
    """The reserve growing step after step beyond what is kept, by at least `min_share` of the reserved peak."""
    levels = ctx.step_levels
    window = measured(levels)
    if not window:
        return []
    starts = levels[1:]
    excess = np.array([lv.reserved_bytes - lv.high_water_bytes for lv in starts])
    grew = int((np.diff(excess) > 0).sum())
    rate = (excess[-1] - excess[0]) / len(window)
    kept_rate = (starts[-1].kept_bytes - starts[0].kept_bytes) / len(window)
    reserved_peak = int(ctx.timeline["reserved_bytes"].max())
    noise = min_share * reserved_peak
    if grew < max(MIN_MEASURED_STEPS, math.ceil(len(window) / 2)) or rate < noise or kept_rate >= noise:
        return []
    reserved_rate = (starts[-1].reserved_bytes - starts[0].reserved_bytes) / len(window)
    steps_to_oom = None if ctx.capacity_bytes is None else \
        max(0, math.ceil((ctx.capacity_bytes - reserved_peak) / reserved_rate))
    steps = [lv.step for lv in window]
    runway = "" if steps_to_oom is None else f"; the reserve reaches the device in about {steps_to_oom} more steps"
    return [ReservedGrowthFinding(
        severity="warning", bytes=int(excess[-1] - excess[0]), bytes_per_step=int(reserved_rate), steps_to_oom=steps_to_oom,
        summary=(f"Reserved memory grows by {rate_bytes(reserved_rate)} every step (steps {steps[0]}-{steps[-1]}) while "
                 f"the highest allocation does not: the caching allocator keeps segments it cannot reuse "
                 f"(fragmentation, not a leak of tensors){runway}"),
        evidence=Evidence(event_index=[starts[0].start_seq, starts[-1].start_seq],
                          details=ReservedGrowthDetails(measured_steps=steps, levels=as_json(levels),
                                                        unused_reserve_growth_per_step=int(rate),
                                                        reserved_peak_bytes=reserved_peak)),
    )]
