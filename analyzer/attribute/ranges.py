"""Which annotation range encloses a moment: vectorised interval stabbing over nested ranges."""
from __future__ import annotations

import numpy as np
import pandas as pd


def innermost(ranges: pd.DataFrame, times: np.ndarray, priority: np.ndarray | None = None) -> np.ndarray:
    """For each time, the row position in `ranges` (columns start_us, end_us) of the innermost range that
    contains it, or -1. Innermost is the latest opened of the open ranges, or with `priority`, the open
    range of highest priority (e.g. the deepest module name, for ranges that overlap without nesting). A
    range still open at the end of the recording (end NA) runs to the end.

    A sweep over starts and ends turns the ranges into a step function "innermost open range after time
    t", which searchsorted then evaluates for all times at once."""
    if ranges.empty or len(times) == 0:
        return np.full(len(times), -1, dtype=np.int64)
    starts = ranges["start_us"].to_numpy(dtype=np.float64, na_value=-np.inf)
    ends = ranges["end_us"].to_numpy(dtype=np.float64, na_value=np.inf)
    # events: (time, kind, range); ends before starts at equal times, so adjacent ranges do not overlap
    points = np.concatenate([starts, ends])
    kinds = np.concatenate([np.ones(len(starts)), np.zeros(len(ends))])
    ids = np.concatenate([np.arange(len(starts)), np.arange(len(ends))])
    order = np.lexsort((kinds, points))
    stack: list[int] = []
    open_set: set[int] = set()
    change_times, change_values = [], []
    for i in order:
        r = int(ids[i])
        if kinds[i]:
            stack.append(r)
            open_set.add(r)
        else:
            open_set.discard(r)
            while stack and stack[-1] not in open_set:  # ranges closed out of order are dropped lazily
                stack.pop()
        change_times.append(points[i])
        if priority is None or not stack:
            change_values.append(stack[-1] if stack else -1)
        else:  # highest priority among the open ranges, the latest opened on ties
            change_values.append(max(reversed([s for s in stack if s in open_set]), key=lambda s: priority[s]))
    step_times = np.asarray(change_times)
    step_values = np.asarray(change_values, dtype=np.int64)
    position = np.searchsorted(step_times, times.astype(np.float64), side="right") - 1
    return np.where(position >= 0, step_values[np.maximum(position, 0)], -1)
