"""The phase of allocations without Python frames, in a recording that has them.

Autograd runs the backward pass on its own thread, whose allocations carry no Python frames: that is why a
frameless allocation has long been taken for backward work. It is not always: a kernel library or a
communication thread allocates without Python frames in the forward pass too (bitsandbytes dequantising a
4-bit weight inside a QLoRA forward, DataParallel's scatter), and a gradient label there tells a user that
gradients grow through their forward. So:

- where the recording kept C++ frames (`stacks="all"`), a frameless allocation is backward work only when
  those frames show autograd's engine running it; otherwise its phase is left to its neighbours in time;
- where it kept Python frames only, a short run of frameless allocations (at most MAX_FORWARD_RUN in a row)
  between two allocations of the forward pass belongs to that forward pass; a longer run is autograd's
  backward, as before.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from analyzer.core.vocabulary import Phase

MAX_FORWARD_RUN = 2  # frameless allocations in a row that still read as part of the forward around them


def frameless_phases(frameless: np.ndarray, phase: np.ndarray, t_alloc: np.ndarray,
                     native_recorded: bool) -> tuple[np.ndarray, np.ndarray]:
    """Phase and signal for the `frameless` rows (None elsewhere), given the phases decided so far and whether
    the recording kept C++ frames. Those showing autograd's engine were already decided by their frames
    (`frames:autograd-engine`, analyzer.attribute.frames), so with C++ frames kept the rest are left alone."""
    values = np.full(len(phase), None, dtype=object)
    signals = np.full(len(phase), None, dtype=object)
    if not frameless.any() or native_recorded:
        return values, signals
    order = np.argsort(np.where(np.isnan(t_alloc), np.inf, t_alloc), kind="stable")
    order = order[~np.isnan(t_alloc[order])]
    gap = frameless[order]
    run = np.cumsum(np.r_[True, gap[1:] != gap[:-1]])  # runs of frameless / framed rows, in time
    framed_phase = pd.Series(np.where(gap, None, phase[order]), dtype=object)
    before = framed_phase.ffill().to_numpy(dtype=object)
    after = framed_phase.bfill().to_numpy(dtype=object)
    length = pd.Series(run).map(pd.Series(run).value_counts()).to_numpy()
    inside_forward = gap & (length <= MAX_FORWARD_RUN) & (before == Phase.FORWARD) & (after == Phase.FORWARD)
    rows = order[gap]
    values[rows] = np.where(inside_forward[gap], Phase.FORWARD.value, Phase.BACKWARD.value)
    signals[rows] = np.where(inside_forward[gap], "timing:inside-forward", "timing:no-python-frames")
    return values, signals
