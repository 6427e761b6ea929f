"""Which annotation range encloses a moment: vectorised interval stabbing over nested ranges."""
from __future__ import annotations

import numpy as np
import pandas as pd


def innermost(ranges: pd.DataFrame, times: np.ndarray) -> np.ndarray:
    """For each time, the row position in `ranges` (columns start_us, end_us) of the innermost range that
    contains it, or -1. Ranges nest (record_function ranges do); a range still open at the end of the
    recording (end NA) runs to the end.

    A sweep over starts and ends turns the nesting into a step function "innermost open range after time
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
        change_values.append(stack[-1] if stack else -1)
    change_times = np.asarray(change_times)
    change_values = np.asarray(change_values, dtype=np.int64)
    position = np.searchsorted(change_times, times.astype(np.float64), side="right") - 1
    return np.where(position >= 0, change_values[np.maximum(position, 0)], -1)
