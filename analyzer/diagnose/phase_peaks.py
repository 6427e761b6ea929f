"""Peaks inside one phase compared with the peak everywhere else: the shared measure behind the optimizer
spike and checkpoint gather detectors."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from analyzer.diagnose.context import DeviceContext


@dataclass
class PhasePeak:
    bytes: int            # highest allocated bytes while the phase runs
    seq: int              # the event of that peak
    elsewhere: int        # highest allocated bytes outside the phase (and outside `ignore`)


def phase_peak(ctx: DeviceContext, phase: str, ignore: tuple[str, ...] = ()) -> PhasePeak | None:
    seq = ctx.timeline["seq"].to_numpy()
    after_event = seq >= 0      # the two columns it reads, not the whole timeline taken
    phases = ctx.labels["phase"].to_numpy()[: int(after_event.sum())]
    if not len(phases):
        return None
    inside = phases == phase
    if not inside.any():
        return None
    allocated = ctx.timeline["allocated_bytes"].to_numpy()[after_event]
    outside = ~inside
    for other in ignore:
        outside &= phases != other
    best = int(np.argmax(np.where(inside, allocated, -1)))
    return PhasePeak(bytes=int(allocated[best]), seq=int(seq[after_event][best]),
                     elsewhere=int(allocated[outside].max()) if outside.any() else 0)
