"""Intervals on one thread's time axis: which span is open at a moment (a profiler trace's ops and calls around
each allocation), for the reader that assigns events to ops and for the attribution that names them."""
from __future__ import annotations

import numpy as np

_SKIP_DEPTH = 8


def innermost_open(start: np.ndarray, end: np.ndarray, times: np.ndarray,
                   skip: np.ndarray | None = None) -> np.ndarray:
    """For spans of one thread (in file order) and event times: the position of the innermost span open at each
    time (the latest started of those whose [start, end] holds it), -1 where none; with `skip`, passing over
    open spans marked in it to the one below (an op that only allocates for the op around it).

    One sweep over spans and events in time order with a stack of started spans: a span is pushed once and
    popped once, so a long chain of ended spans followed by many events costs no more than its length."""
    out = np.full(len(times), -1, dtype=np.int64)
    if not len(start) or not len(times):
        return out
    order = np.argsort(start, kind="stable")
    starts, ends = start[order].tolist(), end[order].tolist()
    skipped = skip[order].tolist() if skip is not None else None
    stack: list[int] = []
    pushed = 0
    for event in np.argsort(times, kind="stable").tolist():
        t = times[event]
        while pushed < len(starts) and starts[pushed] <= t:
            stack.append(pushed)
            pushed += 1
        while stack and ends[stack[-1]] < t:
            stack.pop()
        if not stack:
            continue
        found = stack[-1]
        if skipped is not None and skipped[found]:
            # bounded look below: allocating ops sit directly inside the op they allocate for
            below = [s for s in stack[-_SKIP_DEPTH:-1] if ends[s] >= t and not skipped[s]]
            found = below[-1] if below else found
        out[event] = order[found]
    return out
