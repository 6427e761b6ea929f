"""Which annotation range encloses a moment: vectorised interval stabbing over nested ranges."""
from __future__ import annotations

import heapq

import numpy as np
import pandas as pd


def innermost(ranges: pd.DataFrame, times: np.ndarray, priority: np.ndarray | None = None) -> np.ndarray:
    """For each time, the row position in `ranges` (columns start_us, end_us) of the innermost range that
    contains it, or -1. Innermost is the latest opened of the open ranges, or with `priority`, the open
    range of highest priority (e.g. the deepest module name, for ranges that overlap without nesting). A
    range still open at the end of the recording (end NA) runs to the end.

    A sweep over starts and ends turns the ranges into a step function "innermost open range after time
    t", which searchsorted then evaluates for all times at once. Closed ranges leave the stack (or the priority
    heap) lazily, when they reach its top, so the sweep is O(n log n) even for 300k ranges that never end."""
    if ranges.empty or len(times) == 0:
        return np.full(len(times), -1, dtype=np.int64)
    starts = ranges["start_us"].to_numpy(dtype=np.float64, na_value=-np.inf)
    ends = ranges["end_us"].to_numpy(dtype=np.float64, na_value=np.inf)
    # events: (time, kind, range); ends before starts at equal times, so adjacent ranges do not overlap
    points = np.concatenate([starts, ends])
    kinds = np.concatenate([np.ones(len(starts)), np.zeros(len(ends))])
    ids = np.concatenate([np.arange(len(starts)), np.arange(len(ends))])
    order = np.lexsort((kinds, points))
    # open ranges, latest opened last (or, with `priority`, a heap of (-priority, -opening, range)); a closed
    # range is dropped only when it reaches the top, so each is pushed and popped once however many stay open
    stack: list[tuple[float, int, int]] = []
    is_open = [False] * len(starts)
    change_times, change_values = [], []
    for opening, i in enumerate(order):
        r = int(ids[i])
        is_open[r] = bool(kinds[i])
        if is_open[r]:
            if priority is None:
                stack.append((0.0, opening, r))
            else:
                heapq.heappush(stack, (-float(priority[r]), -opening, r))
        top = -1 if priority is None else 0
        while stack and not is_open[stack[top][2]]:
            if priority is None:
                stack.pop()
            else:
                heapq.heappop(stack)
        change_times.append(points[i])
        change_values.append(stack[top][2] if stack else -1)
    step_times = np.asarray(change_times)
    step_values = np.asarray(change_values, dtype=np.int64)
    position = np.searchsorted(step_times, times.astype(np.float64), side="right") - 1
    return np.where(position >= 0, step_values[np.maximum(position, 0)], -1)
