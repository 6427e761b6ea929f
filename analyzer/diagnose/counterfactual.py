"""Counterfactual replay: the run as it would have been with a remedy applied, through the allocator model.

A remedy's formula says how much of the peak's breakdown it removes. Replaying says more: the recorded,
attributed allocation stream is edited as the remedy would change it (`analyzer.diagnose.transforms`) and fed,
in order, to the caching-allocator model (`analyzer.simulate.allocator`) on a device of the known capacity, with
the allocator options the recording ran with (`max_split_size_mb`, `roundup_power2_divisions`, expandable
segments, as a snapshot's `allocator_settings` reports them). The
replay gives the new peak of allocated *and* reserved bytes, wherever in the run it moves to, and whether an
allocation would still fail, fragmentation included: the model splits, caches and releases blocks as torch does.

An input without an allocation history (an end state only, a profiler trace without addresses) has no stream
to edit: the remedies keep their formula there.
"""
from __future__ import annotations

from collections.abc import Callable
from copy import copy
from dataclasses import dataclass, replace

import numpy as np
import pandas as pd

from analyzer.core.trace import MemoryTrace
from analyzer.core.vocabulary import Category, Phase
from analyzer.diagnose.context import DeviceContext
from analyzer.diagnose.remedies import BY_ID, REMEDIES, Demand, zero_shards
from analyzer.diagnose.transforms import Stream
from analyzer.result import Replayed
from analyzer.simulate.allocator import AllocatorSettings, CachingAllocator
from analyzer.simulate.device import DeviceMemory
from analyzer.simulate.requests import Requests, feed

_RELEASES = ("segment_free", "segment_unmap")
_LABELS = ("category", "phase", "module")
# what a failed request would have been, by the phase it failed in (the rest: other)
_FAILED = {Phase.FORWARD.value: Category.ACTIVATION.value, Phase.BACKWARD.value: Category.TEMPORARY.value,
           Phase.OPTIMIZER.value: Category.OPTIMIZER_STATE.value}


@dataclass(frozen=True)
class Prediction:
    """The replayed run: its peaks, and whether (and at which recorded event) a request would fail."""

    peak_allocated_bytes: int
    peak_reserved_bytes: int
    oom: bool | None              # None: the device's capacity is unknown
    oom_at: int | None = None     # the recorded event the first failing request comes at (or after)

    def to_dict(self) -> Replayed:
        return {"peak_allocated_bytes": self.peak_allocated_bytes, "peak_reserved_bytes": self.peak_reserved_bytes,
                "oom": self.oom, "oom_at_event": self.oom_at}


Transform = Callable[[Stream], Stream]


def _acts_on(stream: Stream, changed: Stream, layout: bool) -> bool:
    """Whether a remedy's transform changed anything the replay can see: a row's size or lifetime, a row added,
    or (`layout`) the allocator's layout. Where it changed nothing the labels show nothing it acts on (a memory
    timeline without phases, a run without an optimizer): the replay would say it saves 0, the formula judges."""
    before, after = stream.rows, changed.rows
    return layout or len(before) != len(after) or not all(   # by value: a transform may widen a column's dtype
        np.array_equal(before[column].to_numpy(dtype=np.float64), after[column].to_numpy(dtype=np.float64),
                       equal_nan=True) for column in ("bytes", "at", "until"))


def transform_for(remedy: str, value: int | None, shards: dict[str, int]) -> tuple[Transform, bool] | None:
    """(transform, expandable segments) of one remedy at a level (`value`: k micro-batches, 2 when not given; a
    sharded remedy over the GPU count `shards` gives it, only above 1), or None where the remedy has no replay."""
    spec = BY_ID.get(remedy)
    if spec is None or spec.replay is None:
        return None
    made = spec.replay
    level = shards.get(remedy, 0) if made.sharded else value or 2
    if made.sharded and level <= 1:
        return None
    return (lambda s: made.transform(s, level)), made.expandable


class Replayer:
    """One device's recorded stream, read once, replayed with any combination of remedies composed in order. A
    remedy is replayed only where its transform acts on the recording (`can`); the rest keep their formula."""

    def __init__(self, trace: MemoryTrace, device: int, capacity: int | None, shards: dict[str, int]):
        self.trace, self.device, self.shards = trace, device, shards
        self.usable = usable_capacity(trace, device, capacity)
        self.settings = recorded_settings(trace)
        self.replays = 0
        self._stream: Stream | None | bool = False     # False: not read yet
        self._acts: dict[tuple[str, int | None], bool] = {}
        self._last: tuple[tuple[str, int | None], Stream] | None = None   # the last change `can` made, for `run`
        self._like: tuple[Stream, Requests] | None = None   # a replayed stream of the recorded places, all made

    @property
    def stream(self) -> Stream | None:
        if self._stream is False:
            self._stream = recorded_stream(self.trace, self.device)
        return self._stream if isinstance(self._stream, Stream) else None

    def can(self, remedy: str, value: int | None) -> bool:
        """A transform exists for the remedy at this level and acts on this recording."""
        made = transform_for(remedy, value, self.shards)
        if made is None or self.stream is None:
            return False
        key = (remedy, value)
        if key not in self._acts:
            changed = made[0](self.stream)
            self._acts[key] = _acts_on(self.stream, changed, made[1] and not self.settings.expandable_segments)
            self._last = (key, changed)
        return self._acts[key]

    def again(self) -> Replayer:
        """A replayer of the same recording that counts its own replays: the stream and what `can` found are
        shared, not read and transformed again (the remedy list's replays and the plan's use one recording)."""
        twin = copy(self)
        twin.replays = 0
        return twin

    def run(self, changes: list[tuple[str, int | None]]) -> Prediction:
        """The run with each change's transform applied to the result of the previous one."""
        assert self.stream is not None and all(self.can(*change) for change in changes)   # callers ask `can` first
        stream, expandable = self.stream, self.settings.expandable_segments
        for i, (remedy, value) in enumerate(changes):
            made = transform_for(remedy, value, self.shards)
            assert made is not None
            cached = self._last if i == 0 and self._last is not None and self._last[0] == (remedy, value) else None
            stream = cached[1] if cached is not None else made[0](stream)
            expandable = expandable or made[1]
        self.replays += 1
        requests = requests_of(stream, self._like)
        if self._like is None and self.stream is not None and (stream.rows["bytes"].to_numpy() > 0).all() \
                and _same_places(stream.rows, self.stream.rows):
            self._like = (stream, requests)    # the recorded places: a transform that only resizes takes their order
        return replay(stream, self.usable, replace(self.settings, expandable_segments=expandable), requests=requests)


def recorded_settings(trace: MemoryTrace) -> AllocatorSettings:
    """The allocator options of the recording, as torch reports them (`max_split_size` in bytes, -1 when unset;
    `roundup_power2_divisions` by interval); a value of another type, or none, is the default."""
    given = trace.allocator_settings or {}
    split, divisions = given.get("max_split_size"), given.get("roundup_power2_divisions")
    by_interval = divisions.items() if isinstance(divisions, dict) else ()
    return AllocatorSettings(expandable_segments=given.get("expandable_segments") is True,
                             max_split_size=split if type(split) is int and split > 0 else None,
                             roundup_power2_divisions={str(k): v for k, v in by_interval
                                                       if str(k).isdecimal() and type(v) is int and v >= 0})


def recorded_stream(trace: MemoryTrace, device: int) -> Stream | None:
    """The device's attributed allocations as a stream, with the request that failed at the recorded OOM (alive
    to the end); None without an allocation history."""
    if not trace.has_history:
        return None
    a = trace.allocations[trace.allocations["device"] == device]
    if not a["seq_alloc"].notna().any():
        return None
    rows = pd.DataFrame({
        "at": a["seq_alloc"].to_numpy(dtype=np.float64, na_value=-1.0),
        "until": a["seq_free"].to_numpy(dtype=np.float64, na_value=np.inf),
        "bytes": a["requested_bytes"].to_numpy(dtype=np.int64), "stream": a["stream"].to_numpy(dtype=np.int64),
        **{label: _categories(a[label]) for label in _LABELS}, "step": a["step"].to_numpy(dtype=np.float64, na_value=-1.0),
        "stack_id": a["stack_id"].to_numpy(dtype=np.float64, na_value=np.nan)})
    ooms = trace.ooms[trace.ooms["device"] == device]
    if len(ooms):
        seq = float(ooms["seq"].iloc[-1])
        before = rows[(rows["at"] < seq) & (rows["at"] >= 0)]
        last = before.loc[before["at"].idxmax()] if len(before) else None
        phase = str(last["phase"]) if last is not None else Phase.OTHER.value
        failed = {"at": seq, "until": np.inf, "bytes": int(ooms["requested_bytes"].iloc[-1]), "stream": 0,
                  "category": _FAILED.get(phase, Category.OTHER.value), "phase": phase, "module": "unattributed",
                  "step": float(last["step"]) if last is not None else -1.0, "stack_id": np.nan}
        rows = pd.concat([rows, pd.DataFrame([failed])], ignore_index=True)
        rows = rows.astype({label: "category" for label in _LABELS})   # the failed request's labels joined them
    return Stream(rows=rows, releases=_releases(trace, device), stacks=trace.stacks, grad_mode=trace.grad_mode)


def _categories(labels: pd.Series) -> pd.Categorical:
    """A label column as categories of strings (attribution makes them so; a missing label reads "nan"): the
    transforms compare labels dozens of times, a category at a time, not a string a row."""
    if isinstance(labels.dtype, pd.CategoricalDtype) and not labels.hasnans and all(
            isinstance(c, str) for c in labels.cat.categories):
        return pd.Categorical(labels.array)
    return pd.Categorical(labels.astype(str).to_numpy(dtype=object))


def _releases(trace: MemoryTrace, device: int) -> np.ndarray:
    """Where the allocator released its cache (a burst of segment frees: empty_cache, or a failed cudaMalloc the
    model reproduces by itself from the capacity), less the bursts that end in the recorded OOM."""
    events = trace.events[trace.events["device"] == device]
    action = events["action"].astype(str).to_numpy()
    release = np.isin(action, _RELEASES)
    starts = np.flatnonzero(release & ~np.concatenate([[False], release[:-1]]))
    seqs = events["seq"].to_numpy()
    keep = []
    for start in starts:
        end = start
        while end < len(action) and release[end]:
            end += 1
        if end >= len(action) or action[end] != "oom":
            keep.append(float(seqs[start]))
    return np.asarray(keep, dtype=np.float64)


def requests_of(stream: Stream, like: tuple[Stream, Requests] | None = None) -> Requests:
    """The stream's requests, in position order (frees before allocations at one position); a row of 0 bytes
    makes none. `like`: a stream whose every row makes one, and its requests: where this stream has the same rows
    made and freed at the same places (a transform that only resized rows), its order is taken, with these sizes."""
    rows = stream.rows
    sizes = rows["bytes"].to_numpy()
    made = sizes > 0   # the columns the model needs, not every column of the rows (a long run's strings)
    if like is not None and made.all() and _same_places(rows, like[0].rows) and \
            np.array_equal(stream.releases, like[0].releases):
        return like[1].resized(sizes)
    return Requests.of(rows["at"].to_numpy(dtype=np.float64)[made], rows["until"].to_numpy(dtype=np.float64)[made],
                       sizes[made], rows["stream"].to_numpy()[made], stream.releases)


def _same_places(rows: pd.DataFrame, other: pd.DataFrame) -> bool:
    return len(rows) == len(other) and all(np.array_equal(rows[c].to_numpy(), other[c].to_numpy())
                                           for c in ("at", "until", "stream"))


def replay(stream: Stream, capacity: int | None, settings: AllocatorSettings = AllocatorSettings(),
           fast_forward: bool = True, requests: Requests | None = None) -> Prediction:
    """Feed the stream (or its `requests`, made by requests_of) to a fresh allocator on a device of `capacity`
    usable bytes. A request that fails is noted and the replay goes on as if the device were larger, so that the
    peaks are what the whole run would need. Periods that repeat from the same allocator state are skipped
    (`fast_forward`; analyzer.simulate.requests), which changes nothing in the result."""
    requests = requests_of(stream) if requests is None else requests
    fed = feed(CachingAllocator(DeviceMemory(capacity), settings, record=False), requests, fast_forward)
    return Prediction(fed.peak_allocated, fed.peak_reserved, None if capacity is None else fed.oom_at is not None,
                      None if fed.oom_at is None else int(np.ceil(fed.oom_at)))


def usable_capacity(trace: MemoryTrace, device: int, capacity: int | None) -> int | None:
    """What the allocator could have had: the capacity less what the recorded OOM shows was used outside it
    (capacity - reserved - free at the OOM: the CUDA context, other processes)."""
    if capacity is None:
        return None
    ooms = trace.ooms[trace.ooms["device"] == device]
    if not len(ooms) or pd.isna(ooms["device_free_bytes"].iloc[-1]):
        return capacity
    timeline = trace.timeline
    at = timeline[(timeline["device"] == device) & (timeline["seq"] == int(ooms["seq"].iloc[-1]))]
    if at.empty:
        return capacity
    outside = capacity - int(at["reserved_bytes"].iloc[0]) - int(ooms["device_free_bytes"].iloc[-1])
    return capacity - max(outside, 0)


def predict(trace: MemoryTrace, device: int, remedy_ids: list[str], capacity: int | None,
            shards: dict[str, int] | int | None = None) -> dict[str, Prediction]:
    """Replayed predictions for those of `remedy_ids` a transform exists for and acts on the recording (nothing
    without a history); `shards`: the GPU count of each ZeRO remedy, or one count for all."""
    counts = shards if isinstance(shards, dict) else {r.id.value: shards or 0 for r in REMEDIES
                                                      if r.replay is not None and r.replay.sharded}
    return _single(Replayer(trace, device, capacity, counts), remedy_ids)


def _single(replayer: Replayer, remedy_ids: list[str]) -> dict[str, Prediction]:
    return {remedy: replayer.run([(remedy, None)]) for remedy in remedy_ids if replayer.can(remedy, None)}


def replayer_for(ctx: DeviceContext, demand: Demand) -> Replayer:
    """The device's replayer; a ZeRO remedy is replayed over the GPU count its title names."""
    return Replayer(ctx.trace, ctx.device, ctx.capacity_bytes, zero_shards(demand))


def replayed(ctx: DeviceContext, replayer: Replayer, offered: list[str]) -> dict[str, Replayed]:
    """The replayed predictions of the offered remedies, as the remedy list carries them."""
    if ctx.device < 0:
        return {}
    return {remedy: p.to_dict() for remedy, p in _single(replayer, offered).items()}
