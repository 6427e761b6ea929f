"""Number the training iterations: from ProfilerStep#N ranges, else from Optimizer.step ends, else from
the phase cycle (a forward allocation after backward or optimizer ones starts a new step)."""
from __future__ import annotations

import numpy as np
import pandas as pd

from analyzer.attribute.annotations import optimizer_step_ends, profiler_steps
from analyzer.core.vocabulary import PROFILER_STEP_PREFIX, Phase

NO_STEP = -1


def number_steps(annotations: pd.DataFrame, t_alloc: np.ndarray, phase: np.ndarray) -> np.ndarray:
    """Step of each allocation (0: loading before the first step; NO_STEP: not timed)."""
    timed = ~np.isnan(t_alloc)
    times = np.where(timed, t_alloc, 0.0)
    steps = profiler_steps(annotations, times)
    if (steps >= 0).any():
        first, last = steps[steps >= 0].min(), steps[steps >= 0].max()
        starts = annotations.loc[annotations["name"].str.startswith(PROFILER_STEP_PREFIX), "start_us"].min()
        outside = steps < 0
        steps[outside] = np.where(times[outside] < float(starts), 0 if first > 0 else first, last)
    else:
        ends = optimizer_step_ends(annotations)
        steps = np.searchsorted(ends, times, side="right") + 1 if len(ends) else _phase_cycles(times, phase)
        if len(ends):
            steps = np.minimum(steps, len(ends))  # work after the last optimizer step (a save) belongs to it
    steps = np.where(phase == Phase.LOAD, 0, steps)
    return np.where(timed, steps, NO_STEP).astype(np.int64)


def _phase_cycles(times: np.ndarray, phase: np.ndarray) -> np.ndarray:
    """Without annotations: a step begins at each forward allocation that follows backward/optimizer work
    (in time order, looking only at allocations of those three phases)."""
    order = np.argsort(times, kind="stable")
    ordered = phase[order]
    training = np.isin(ordered, [Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER])
    kinds = ordered[training]
    starts = (kinds[1:] == Phase.FORWARD) & np.isin(kinds[:-1], [Phase.BACKWARD, Phase.OPTIMIZER])
    step_of_training = 1 + np.concatenate([[0], np.cumsum(starts)]) if len(kinds) else np.ones(1, dtype=np.int64)
    # every allocation takes the step of the latest training-phase allocation at or before it (1 before any)
    latest = np.cumsum(training) - 1
    steps_ordered = np.where(latest >= 0, step_of_training[np.maximum(latest, 0)], 1)
    steps = np.empty(len(times), dtype=np.int64)
    steps[order] = steps_ordered
    return steps
