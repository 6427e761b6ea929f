"""Memory at the same point of every training step: the measure behind the leak and reserved-growth detectors.

Comparing steps at one point of the step (its start, just before its first allocation) cancels what every
step allocates and frees again (activations, temporaries), so what remains is what the steps keep. The first
recorded step is the warm-up: lazy optimizer state, allocator caching, cuDNN/cuBLAS workspaces all appear in
it once; the last one has not yet had a step boundary to survive. The steps between are the measured ones.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from analyzer.core.vocabulary import MODEL_STATES as MODEL_STATES  # created once; a leak is anything else kept

MIN_MEASURED_STEPS = 2   # growth seen once is an event; seen in two steps or more it is a rate


@dataclass
class StepLevel:
    step: int
    start_seq: int               # the step's first allocation
    allocated_bytes: int         # alive just before it
    model_state_bytes: int       # of which parameters, gradients and optimizer state
    reserved_bytes: int
    high_water_bytes: int        # highest allocated before the step start: what the reserve had to hold so far
    peak_allocated_bytes: int    # highest allocated from this start to the next step's

    @property
    def kept_bytes(self) -> int:
        """What is alive at the step start besides the model states."""
        return self.allocated_bytes - self.model_state_bytes


def step_levels(allocations: pd.DataFrame, timeline: pd.DataFrame) -> list[StepLevel]:
    """One level per training step (step >= 1) of one device, in order; steps whose first allocation does not
    come after the previous step's (mislabelled or interleaved) are left out."""
    a = allocations
    a = a[a["seq_alloc"].notna() & a["step"].notna()]
    a = a[a["step"] >= 1]
    if a.empty:
        return []
    starts = a.groupby("step")["seq_alloc"].min().sort_index()
    tl = timeline
    seq = tl["seq"].to_numpy()
    allocated = tl["allocated_bytes"].to_numpy()
    reserved = tl["reserved_bytes"].to_numpy()
    model = sum((tl[f"{c}_bytes"].to_numpy() for c in MODEL_STATES if f"{c}_bytes" in tl), np.zeros(len(tl), np.int64))
    ordered = [(int(step), int(start)) for step, start in starts.items()]
    ordered = [(s, start) for i, (s, start) in enumerate(ordered) if i == 0 or start > ordered[i - 1][1]]
    high_water = np.maximum.accumulate(allocated)
    levels = []
    for i, (step, start) in enumerate(ordered):
        before = int(np.searchsorted(seq, start - 1))
        end = int(np.searchsorted(seq, ordered[i + 1][1] - 1)) if i + 1 < len(ordered) else len(seq) - 1
        levels.append(StepLevel(step=step, start_seq=start, allocated_bytes=int(allocated[before]),
                                model_state_bytes=int(model[before]), reserved_bytes=int(reserved[before]),
                                high_water_bytes=int(high_water[before]),
                                peak_allocated_bytes=int(allocated[before:end + 1].max())))
    return levels


def measured(levels: list[StepLevel]) -> list[StepLevel]:
    """The steps between the warm-up step and the last one; empty when there are too few to give a rate."""
    inner = levels[1:-1]
    return inner if len(inner) >= MIN_MEASURED_STEPS else []


def as_json(levels: list[StepLevel]) -> list[dict[str, int]]:
    return [{"step": lv.step, "event_index": lv.start_seq, "allocated_bytes": lv.allocated_bytes,
             "kept_bytes": lv.kept_bytes, "reserved_bytes": lv.reserved_bytes, "high_water_bytes": lv.high_water_bytes,
             "peak_allocated_bytes": lv.peak_allocated_bytes} for lv in levels]
