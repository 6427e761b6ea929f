"""An ordered stream of allocation requests fed to the allocator model, skipping the periods known to repeat.

A training run repeats itself step after step: the same requests in the same order, each free releasing what the
same earlier request made. When the model is in the same state at the start of two consecutive periods of such a
run (`CachingAllocator.state`, compared exactly, with the blocks the next period frees at the same addresses),
the second period makes the decisions the first made, reaches the same peaks and ends in the same state, so it
need not be fed: only which allocation holds which block moves on by one period. The period is found from the
requests alone (`Requests.period`); a run without one, or a model that never settles, is fed request by request.
Either way the peaks and the first failure are those of feeding every request (tests/unit/test_fast_forward.py).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property

import numpy as np

from analyzer.simulate.allocator import CachingAllocator, SimulatedOutOfMemory
from analyzer.simulate.blocks import Block

FREE, RELEASE, ALLOC = 0, 1, 2     # event kinds, in the order they are fed at one position
_MIN_EVENTS = 4096                 # below this, looking for a period costs more than it can save
_WINDOW = 32                       # requests that must agree for a distance to be a candidate period
_CANDIDATES = 64                   # distances tried as the period, each judged on a sample of the run
_SAMPLE = 4096
_MIN_SHARE = 0.5                   # a period is used when at least this share of the requests repeats with it
_CLEAR_SHARE = 0.9                 # a period this clear is not looked for elsewhere in the run


@dataclass(frozen=True)
class Period:
    """A stream that repeats every `length` events; periods start at `first` + k * length."""

    length: int
    first: int
    unchanged: np.ndarray        # cumulative count of events that differ from the event one period later


@dataclass(frozen=True)
class Fed:
    """The peaks of the run, where the first request failed (its position) and how many events were fed."""

    peak_allocated: int
    peak_reserved: int
    oom_at: float | None
    fed: int


@dataclass(frozen=True)
class Requests:
    """Events in the order they are fed: a kind, the allocation they make or free (its ordinal: allocations are
    numbered in the order they are made) and their position in the run; sizes and streams by ordinal."""

    kind: np.ndarray
    ordinal: np.ndarray
    position: np.ndarray
    size: np.ndarray
    stream: np.ndarray
    row: np.ndarray       # by ordinal: the row of `of`'s arguments the allocation is

    @classmethod
    def of(cls, at: np.ndarray, until: np.ndarray, size: np.ndarray, stream: np.ndarray,
           releases: np.ndarray) -> Requests:
        """Rows made at `at` and freed at `until` (inf: never), and cache releases; frees come before releases
        and releases before allocations at one position, each kind in row order."""
        n = len(at)
        freed = np.flatnonzero(np.isfinite(until))
        position = np.concatenate([at, until[freed], releases]).astype(np.float64)
        kind = np.concatenate([np.full(n, ALLOC), np.full(len(freed), FREE), np.full(len(releases), RELEASE)])
        row = np.concatenate([np.arange(n), freed, np.zeros(len(releases), dtype=np.int64)])
        order = np.lexsort((kind, position))
        kind, row, position = kind[order], row[order], position[order]
        made = kind == ALLOC
        ordinal_of_row = np.empty(n, dtype=np.int64)
        ordinal_of_row[row[made]] = np.arange(n)
        ordinal = np.where(kind == RELEASE, 0, ordinal_of_row[row])
        by_ordinal = np.empty(n, dtype=np.int64)
        by_ordinal[ordinal_of_row] = np.arange(n)
        return cls(kind.astype(np.int64), ordinal, position, np.asarray(size, dtype=np.int64)[by_ordinal],
                   np.asarray(stream, dtype=np.int64)[by_ordinal], by_ordinal)

    def resized(self, size: np.ndarray) -> Requests:
        """The same requests in the same order with other sizes (`size` by row, as given to `of`): a transform
        that only resizes rows needs no new sort."""
        return replace(self, size=np.asarray(size, dtype=np.int64)[self.row])

    @cached_property
    def made_before(self) -> np.ndarray:
        """Per event: how many allocations were made before it (the period's search and the skipper read it)."""
        made = (self.kind == ALLOC).astype(np.int64)
        return np.cumsum(made) - made

    def _codes(self) -> tuple[np.ndarray, ...]:
        """What must agree for two events to be the same request: kind, size, stream, and for a free how many
        allocations back it made what it frees."""
        is_release = self.kind == RELEASE
        size = np.where(is_release, 0, self.size[self.ordinal])
        stream = np.where(is_release, 0, self.stream[self.ordinal])
        back = np.where(self.kind == FREE, self.made_before - self.ordinal, 0)
        return self.kind, size, stream, back

    def period(self) -> Period | None:
        """The distance at which most of the stream repeats itself exactly, or None."""
        n = len(self.kind)
        if n < _MIN_EVENTS:
            return None
        codes = self._codes()
        mixed = codes[0] + 3 * codes[1] + (codes[2] << 7) * 1_000_003 + (codes[3] << 3) * 998_244_353
        sample = np.linspace(0, n - 1, min(_SAMPLE, n)).astype(np.int64)
        best, share, anchor = 0, 0.0, n // 2
        # looked for from the middle, else a quarter in from either end: the middle can lie where the run does not
        # repeat (where gradient accumulation's two copies of a run without steps meet)
        for where in (n // 2, n // 4, 3 * n // 4):
            length, agree = _best_distance(mixed, where, sample)
            if agree > share:
                best, share, anchor = length, agree, where
            if share >= _CLEAR_SHARE:
                break
        if share < _MIN_SHARE:
            return None
        same = np.ones(n - best, dtype=bool)
        for code in codes:
            same &= code[:-best] == code[best:]
        made = self.kind == ALLOC
        live = np.cumsum(np.where(made, 1, np.where(self.kind == FREE, -1, 0))) - np.where(made, 1, 0)
        start = anchor + int(np.argmin(live[anchor:anchor + best]))     # a period starts where least is alive
        return Period(best, start % best, np.concatenate([[0], np.cumsum(~same)]))


def _best_distance(mixed: np.ndarray, anchor: int, sample: np.ndarray) -> tuple[int, float]:
    """The distance at which the requests after `anchor` come again that most of the `sample` agrees with, and
    the share of the stream that agrees (0 where none comes again)."""
    n = len(mixed)
    pattern = mixed[anchor:anchor + _WINDOW]
    found = np.arange(anchor + 1, max(anchor + 1, n - _WINDOW))
    for k, code in enumerate(pattern.tolist()):    # where the window after the anchor comes again, narrowed
        found = found[mixed[found + k] == code]     # one request at a time (vectorised)
    best, share = 0, 0.0
    for length in (found[:_CANDIDATES] - anchor).tolist():
        at = sample[sample < n - length]
        agree = float(np.mean(mixed[at] == mixed[at + length])) * len(at) / len(sample) if len(at) else 0.0
        if agree > share:
            best, share = length, agree
    return best, share


def feed(model: CachingAllocator, requests: Requests, fast_forward: bool = True) -> Fed:
    """Feed every request to the model in order. A request that fails is noted and the run goes on as if the
    device were larger, so that the peaks are what the whole run needs. With `fast_forward`, a period that
    repeats the one before it from the same state is skipped (the module's docstring says why that is exact)."""
    n = len(requests.kind)
    blocks: list[Block | None] = [None] * len(requests.size)
    period = requests.period() if fast_forward else None
    skip = _Skipper(requests, period) if period is not None else None
    peak_allocated = peak_reserved = fed = 0
    oom_at: float | None = None
    i = 0
    while i < n:
        end = n if skip is None else min(skip.next_boundary(i), n)
        # only what is fed becomes Python ints: a replay of a long run feeds a few periods of it
        ordinals = requests.ordinal[i:end]
        if len(requests.size):
            sizes, streams = requests.size[ordinals].tolist(), requests.stream[ordinals].tolist()
        else:   # cache releases only
            sizes = streams = [0] * len(ordinals)
        for kind, o, size, stream, position in zip(requests.kind[i:end].tolist(), ordinals.tolist(), sizes, streams,
                                                   requests.position[i:end].tolist(), strict=True):
            if kind == ALLOC:
                try:
                    blocks[o] = model.malloc(size, stream)
                except SimulatedOutOfMemory:
                    oom_at = position if oom_at is None else oom_at
                    model.device.capacity = None
                    blocks[o] = model.malloc(size, stream)
                if model.allocated_bytes > peak_allocated:
                    peak_allocated = model.allocated_bytes
                if model.reserved_bytes > peak_reserved:
                    peak_reserved = model.reserved_bytes
            elif kind == FREE:
                block = blocks[o]
                if block is not None:
                    model.free(block)
                    blocks[o] = None
            else:
                model.empty_cache()
        fed += end - i
        i = end if skip is None or end >= n else skip.past_repeats(end, model, blocks)
    return Fed(peak_allocated, peak_reserved, oom_at, fed)


class _Skipper:
    """Where periods begin, and whether the one beginning at a boundary repeats the one before it."""

    def __init__(self, requests: Requests, period: Period) -> None:
        self.requests, self.period = requests, period
        self.made_before = requests.made_before
        free = requests.kind == FREE
        self.freed_at = np.full(len(requests.size), len(requests.kind), dtype=np.int64)
        self.freed_at[requests.ordinal[free]] = np.flatnonzero(free)
        self.last: tuple[int, tuple, tuple[int, ...]] | None = None   # (boundary, model state, _freed_next)

    def next_boundary(self, i: int) -> int:
        first, length = self.period.first, self.period.length
        return first if i < first else first + ((i - first) // length + 1) * length

    def past_repeats(self, i: int, model: CachingAllocator, blocks: list[Block | None]) -> int:
        """From boundary `i`, the first event that must be fed: past every period that repeats the one before."""
        length, n = self.period.length, len(self.requests.kind)
        state = model.state()   # a skipped period leaves the model as it was: its state is read once
        while i < n:
            here = (i, state, self._freed_next(i, model, blocks))
            last, self.last = self.last, here
            if last is None or last[0] != i - length or last[1] != here[1]:
                return i
            if i + length > n:
                # the last, partial period: from the same state, the same requests as the start of the period
                # before (whose frees of earlier blocks it makes, in order, as far as it goes) make the same
                # decisions, so its peaks were reached already and it cannot fail where that one did not
                tail = n - i
                same = (last[2][:len(here[2])] == here[2]
                        and self.period.unchanged[i - length + tail] == self.period.unchanged[i - length])
                return n if same else i
            if last[2] != here[2] or self.period.unchanged[i] != self.period.unchanged[i - length]:
                return i
            # the period from i repeats the one before it, from the same state: what it makes and keeps is where
            # the one before made and kept its own; what it frees it does not use again
            first = int(self.made_before[i])
            after = int(self.made_before[i + length]) if i + length < n else len(blocks)
            back = first - int(self.made_before[i - length])
            for o in (np.flatnonzero(self.freed_at[first:after] >= i + length) + first).tolist():
                blocks[o] = blocks[o - back]
            i += length
        return i

    def _freed_next(self, start: int, model: CachingAllocator, blocks: list[Block | None]) -> tuple:
        """The addresses of the blocks made before `start` that the period from `start` frees, in that order."""
        span = slice(start, start + self.period.length)
        kind, ordinal = self.requests.kind[span], self.requests.ordinal[span]
        made = ordinal[(kind == FREE) & (ordinal < self.made_before[start])]
        return model.places([blocks[o] for o in made.tolist()])
