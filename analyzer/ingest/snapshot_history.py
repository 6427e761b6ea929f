"""A snapshot's `device_traces`: the allocator's history, read column by column and paired with numpy.

Per-entry Python loops cost ~2 µs an entry; large snapshots hold millions. So each field is pulled out of
all entries with one comprehension, stored as int64 (`array('q')` is strict: a string or float where an
integer belongs raises, and the reader reports the file as corrupt), and allocs are paired with their frees
by sorting on (address, position) instead of replaying a dict.
"""
from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from itertools import repeat
from operator import is_, itemgetter
from typing import Any

import numpy as np
import pandas as pd

from analyzer.core.printable import MAX_SHOWN, shorten
from analyzer.core.stacks import stack_op, top_user_frame
from analyzer.core.trace import make_table
from analyzer.ingest.columns import MAX_TOTAL_BYTES, MISSING, to_int64
from analyzer.ingest.fields import require_strings, text

#: trace actions, in the order of their codes in the events table
ACTIONS = ["alloc", "free_requested", "free_completed", "segment_alloc", "segment_free", "segment_map",
           "segment_unmap", "oom", "snapshot", "other"]
ACTION_CODES = {name: code for code, name in enumerate(ACTIONS)}
ALLOC, FREE_REQUESTED, FREE_COMPLETED, OOM, SNAPSHOT, OTHER = (
    ACTION_CODES[a] for a in ("alloc", "free_requested", "free_completed", "oom", "snapshot", "other"))
SEGMENT_CODES = [ACTION_CODES[a] for a in ("segment_alloc", "segment_free", "segment_map", "segment_unmap")]

#: allocation origins: alloc recorded | freed but alloc not recorded | alive at the end, alloc not recorded
ORIGINS = ["trace", "before_trace", "end_state"]
ORIGIN_TRACE, ORIGIN_BEFORE, ORIGIN_END = range(3)

ALLOC_COLUMNS = ("device", "addr", "requested_bytes", "stream", "t_alloc_us", "t_free_us", "seq_alloc", "seq_free",
                 "stack_id", "origin", "user_metadata")


Probe = tuple[int, int, int, int]   # a stack's length and the ids of its first, middle and last frames
Known = tuple[Any, int]              # a known stack: a list of its frames `==` may be used on (or None), its id
_SCALARS = (int, float, bool, type(None))
_UNKNOWN: Known = (None, MISSING)


def _plain(frames: list) -> bool:
    """Frames that `==` compares with any object in a few steps: dicts of at most PLAIN_KEYS string keys whose
    values are scalars or strings, no string longer than PLAIN_CHARS (see StackInterner)."""
    limit = StackInterner.PLAIN_CHARS
    return type(frames) is list and all(
        type(frame) is dict and len(frame) <= StackInterner.PLAIN_KEYS
        and all(type(k) is str and len(k) <= limit and (type(v) in _SCALARS or type(v) is str and len(v) <= limit)
                for k, v in frame.items())
        for frame in frames)


class StackInterner:
    """One id per distinct stack, each converted to tuples once.

    Frame dicts are shared objects in the pickle, and an entry's list is new but for the entries that share
    one (a free's `free_requested` and `free_completed`), so a stack is found by identity, not by reading
    strings. First by the list of the entry before it. Then, for a new list, by prediction: a training run allocates the
    same stacks in the same order step after step, so the stack that followed the last three new lists'
    stacks the last time is compared with it by `==`, which passes over identical elements without looking
    inside them (93% right on the real cpp-frames recording; ~0.3 µs a list, where a probe costs ~1.5 µs).
    The predicted list is one of small plain frames (`_plain`), so that comparing a distinct element costs a
    few scalar comparisons, never a walk into what a hostile pickle nests; lists `==` calls equal have equal
    frames, the same stack. Otherwise by a probe of four identities (length, first, middle and last frame)
    whose known stacks are checked element by element with `is` (never `==` against frames that are not
    plain: a hostile pickle can make that exponential). A key of all frame ids would cost a new int per
    frame: ~4 µs an entry, so it is made only where a probe is shared by more than PROBE_CANDIDATES stacks
    (stacks built to share first, middle and last frames would otherwise be compared with each other,
    quadratically). New lists are met in the entries' order, so ids follow the order stacks first appear in."""

    PROBE_CANDIDATES = 4
    LONG = 1024   # frames: the real recordings' stacks have at most 303
    PLAIN_KEYS = 8
    PLAIN_CHARS = MAX_SHOWN

    def __init__(self) -> None:
        self._by_probe: dict[Probe, list[tuple[Any, int, Any]]] = {}   # (as Known, and the list)
        self._by_ids: dict[tuple[int, ...], Known] = {}   # all frame ids, for stacks whose probe is crowded
        self._by_content: dict[tuple, int] = {}
        self._previous: tuple[Any, int] = (None, MISSING)   # the last entry's list, and its stack id
        self._long_lists: dict[int, int] = {}   # id of a list of more than LONG frames: its stack id
        self._by_frame: dict[int, tuple] = {}   # id of a frame dict: its (file, line, function)
        self._next: dict[tuple[int, int, int], Known] = {}   # the last three new lists' stacks: the one after them
        self._recent = (MISSING, MISSING, MISSING)
        self.frames: list[tuple] = []
        self.shortened = 0   # frame strings longer than MAX_SHOWN, kept as their start and end

    def _short(self, value: str) -> str:
        """A file or function name of at most MAX_SHOWN characters (a path has at most 4096): a 4 MiB name in
        forty frames would make every report and the JSON hundreds of megabytes."""
        if len(value) <= MAX_SHOWN:
            return value
        self.shortened += 1
        return shorten(value)

    def _frame(self, frame: Any) -> tuple:
        """A frame dict as (file, line, function), converted once per frame object: stacks share their frames,
        and converting every frame of every stack was quadratic in a snapshot of 3,000 distinct stacks of the
        same 1,500 frames (the frame objects stay alive with their stacks, so their ids stay unique)."""
        converted = self._by_frame.get(id(frame))
        if converted is None:
            converted = self._by_frame[id(frame)] = (
                self._short(text(frame.get("filename", "??"), "frame filename")), int(frame.get("line", 0) or 0),
                self._short(text(frame.get("name", "??"), "frame name")))
        return converted

    def intern(self, frames: Any) -> int:
        """Stack id of `frames`, or MISSING when there are none."""
        return self._find(frames)[1] if frames else MISSING

    def _find(self, frames: Any) -> Known:
        """The known stack with the same frame objects (the probe holds the length), else a new one."""
        probe = (len(frames), id(frames[0]), id(frames[len(frames) >> 1]), id(frames[-1]))
        candidates = self._by_probe.get(probe)
        if candidates is None:
            candidates = self._by_probe[probe] = []
        crowded = len(candidates) >= self.PROBE_CANDIDATES
        if crowded:
            ids = tuple(map(id, frames))
            found = self._by_ids.get(ids)
            if found is not None:
                return found
        else:
            for known in candidates:
                if all(map(is_, known[2], frames)):
                    return known[:2]
        content = tuple(map(self._frame, frames))
        sid = self._by_content.setdefault(content, len(self.frames))
        if sid == len(self.frames):
            self.frames.append(content)
        new: Known = (frames if _plain(frames) else None, sid)
        if crowded:
            self._by_ids[ids] = new
        candidates.append((*new, frames))  # also keeps the frames alive, so the ids in probes stay unique
        return new

    def intern_all(self, frame_lists: list[Any], out: array) -> None:
        """Append the stack ids of many entries to `out`. An entry whose list is the one before it (a free's
        `free_requested` and `free_completed` share one) has its id; lists without frames (None, empty) are
        MISSING. A new list is compared with the predicted stack, else found by `_find` (see the class): this
        runs once per entry of large snapshots, so the loop does no more than that (a dict of every list seen,
        for the pairs, cost more than the pairs it found). Lists longer than LONG frames are remembered by id,
        so that a file repeating one long list costs a lookup an entry, not a walk of the list: that is safe even
        as entries are released, as every list looked up was made by the unpickler before any was freed, so no
        two of them ever share an id."""
        following = self._next
        before, last, recent = self._recent
        previous, sid = self._previous
        append = out.append
        long_lists, long = self._long_lists, self.LONG
        for frames in frame_lists:
            if frames is not previous:
                previous = frames
                if not frames:
                    sid = MISSING
                    append(sid)
                    continue
                if len(frames) > long and (seen := long_lists.get(id(frames))) is not None:
                    sid = seen
                    append(sid)
                    continue
                context = (before, last, recent)
                predicted = following.get(context, _UNKNOWN)
                if predicted[0] == frames:
                    sid = predicted[1]
                else:
                    found = self._find(frames)
                    sid = found[1]
                    if found[0] is not None:
                        following[context] = found
                if len(frames) > long:
                    long_lists[id(frames)] = sid
                before, last, recent = last, recent, sid
            append(sid)
        self._recent = (before, last, recent)
        self._previous = (previous, sid)

    def table(self) -> pd.DataFrame:
        return make_table("stacks", {
            "stack_id": np.arange(len(self.frames), dtype=np.int64),
            "frames": self.frames,
            "top_user_frame": [top_user_frame(f) for f in self.frames],
            "op": [stack_op(f) for f in self.frames],
        })


@dataclass
class DeviceHistory:
    """One device's trace as int64 columns (MISSING marks NA)."""

    device: int
    events: dict[str, np.ndarray]
    allocs: dict[str, np.ndarray]
    ooms: dict[str, np.ndarray]
    segment_events: list[tuple] = field(default_factory=list)  # (device, seq, t_us, action, addr, size, stream)
    has_history: bool = False
    double_allocs: int = 0
    unknown_actions: dict[str, int] = field(default_factory=dict)


#: the most microseconds a time may be from zero (~285 years, as for profiler traces): beyond it a time is corrupt,
#: and ±2**63 would wrap every duration computed from it
MAX_TIME_US = 2**53
CHUNK = 1 << 16  # entries read at a time: with `consume`, each chunk is released once its columns are out


def _columns(chunk: list, stacks: StackInterner, out: dict[str, array], metadata: dict[str, int]) -> None:
    """Append one chunk's fields to the int64 columns in `out`. The loops run in C (map over dict.get);
    array('q') rejects anything that is not an integer, and a non-dict entry fails dict.get: both surface
    as a corrupt file. Actions and labels must be strings before they are hashed (see analyzer.ingest.fields)."""
    get = dict.get
    actions = list(map(itemgetter("action"), chunk))
    require_strings(actions, "trace entry actions")
    out["action"].extend(map(ACTION_CODES.get, actions, repeat(OTHER)))
    out["t_us"].extend(map(get, chunk, repeat("time_us"), repeat(MISSING)))
    out["addr"].extend(map(get, chunk, repeat("addr"), repeat(0)))
    out["bytes"].extend(map(itemgetter("size"), chunk))
    out["stream"].extend(map(get, chunk, repeat("stream"), repeat(0)))
    stacks.intern_all(list(map(get, chunk, repeat("frames"))), out["stack_id"])
    if chunk and "user_metadata" in chunk[0]:  # torch >= 2.10: one label string per entry, mostly ""
        labels = list(map(get, chunk, repeat("user_metadata"), repeat("")))
        require_strings(labels, "trace entry user_metadata")
        for label in set(labels).difference(metadata):  # new labels get the next codes; lookups stay in C
            metadata[label] = len(metadata)
        out["user_metadata"].extend(map(metadata.__getitem__, labels))
    else:
        out["user_metadata"].extend(repeat(0, len(chunk)))


def read_device_history(device: int, trace: list, stacks: StackInterner, metadata: dict[str, int],
                        consume: bool = False) -> DeviceHistory:
    """Columns of one device's trace, and its allocations paired. With `consume`, entries are released
    chunk by chunk, so memory stays close to the size of the unpickled file. Sizes must not be negative, and
    their sum must stay within MAX_TOTAL_BYTES, so that no total built on them can wrap around."""
    n = len(trace)
    total_bytes = 0.0
    raw = {k: array("q") for k in ("action", "t_us", "addr", "bytes", "stream", "stack_id", "user_metadata")}
    unknown: dict[str, int] = {}
    device_free: dict[int, int] = {}  # seq of each oom entry -> the free bytes it reports
    for start in range(0, n, CHUNK):
        chunk = trace[start:start + CHUNK]
        if len(set(map(id, chunk))) < len(chunk):  # torch writes a new dict per entry; a pickle's memo can repeat one
            raise ValueError(f"device {device}: the trace repeats the same entry object (references, not entries: "
                             f"{n} of them from a few bytes)")
        _columns(chunk, stacks, raw, metadata)
        codes = to_int64(raw["action"][start:])  # a copy: a view would pin the growing array
        sizes = to_int64(raw["bytes"][start:])
        if len(sizes) and sizes.min() < 0:
            first = int(np.argmax(sizes < 0))
            raise ValueError(f"device {device}: trace entry {start + first} has a negative size ({sizes[first]})")
        times = to_int64(raw["t_us"][start:])
        if len(times) and np.any((np.abs(times) > MAX_TIME_US) & (times != MISSING)):
            first = int(np.argmax((np.abs(times) > MAX_TIME_US) & (times != MISSING)))
            raise ValueError(f"device {device}: trace entry {start + first} has a time of {times[first]} µs, "
                             f"beyond ±{MAX_TIME_US}")
        total_bytes += float(sizes.sum(dtype=np.float64))
        if total_bytes > MAX_TOTAL_BYTES:
            raise ValueError(f"device {device}: trace entry sizes add up to more than {MAX_TOTAL_BYTES} bytes")
        for i in np.flatnonzero(codes == OOM):
            free = chunk[i].get("device_free", MISSING)
            if free != MISSING and not (type(free) is int and 0 <= free <= MAX_TOTAL_BYTES):
                raise ValueError(f"device {device}: oom entry {start + int(i)} has device_free {str(free)[:40]}, "
                                 f"outside 0..{MAX_TOTAL_BYTES}")
            device_free[start + int(i)] = free
        for i in np.flatnonzero(codes == OTHER):
            name = chunk[i]["action"][:40]
            unknown[name] = unknown.get(name, 0) + 1
        if consume:
            trace[start:start + len(chunk)] = [None] * len(chunk)
        del chunk
    events = {k: to_int64(v) for k, v in raw.items()}
    codes = events["action"]
    events["device"] = np.full(n, device, dtype=np.int64)
    events["seq"] = np.arange(n, dtype=np.int64)
    oom_rows = np.flatnonzero(codes == OOM)
    ooms = {
        "device": np.full(len(oom_rows), device, dtype=np.int64), "seq": oom_rows,
        "t_us": events["t_us"][oom_rows], "requested_bytes": events["bytes"][oom_rows],
        "device_free_bytes": to_int64(array("q", [device_free[int(i)] for i in oom_rows])), "stack_id": events["stack_id"][oom_rows],
    }
    segment_rows = np.flatnonzero(np.isin(codes, SEGMENT_CODES))
    segment_events = [(device, int(i), int(events["t_us"][i]), ACTIONS[codes[i]], int(events["addr"][i]),
                       int(events["bytes"][i]), int(events["stream"][i])) for i in segment_rows]
    allocs, double_allocs = pair_allocations(device, events)
    return DeviceHistory(device=device, events=events, allocs=allocs, ooms=ooms, segment_events=segment_events,
                         has_history=bool(np.any(codes != SNAPSHOT)), double_allocs=double_allocs,
                         unknown_actions=unknown)


def pair_allocations(device: int, events: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], int]:
    """One row per allocation: each alloc with the next free of its address; frees with no alloc before
    them (the history started later) become rows of origin before_trace.

    `free_requested` ends an allocation (torch lowers allocated bytes there); the `free_completed` that
    follows it for the same address (once the streams are done with the block) is not a second free.
    Returns the columns and the number of addresses allocated twice without a free (corrupt history)."""
    codes = events["action"]
    seq = np.flatnonzero((codes == ALLOC) | (codes == FREE_REQUESTED) | (codes == FREE_COMPLETED))
    addr = events["addr"][seq]
    order = np.lexsort((seq, addr))
    seq, addr, code = seq[order], addr[order], codes[seq][order]
    same_prev = np.r_[False, addr[1:] == addr[:-1]]
    completion = (code == FREE_COMPLETED) & same_prev & np.r_[False, code[:-1] == FREE_REQUESTED]
    seq, addr, code = seq[~completion], addr[~completion], code[~completion]
    same_next = np.r_[addr[1:] == addr[:-1], False]
    is_alloc = code == ALLOC
    next_seq = np.r_[seq[1:], MISSING]
    # the next event of the same address ends an allocation: its free, or (corrupt history) another alloc
    alloc_free = np.where(same_next, next_seq, MISSING)[is_alloc]
    double_allocs = int(np.sum(is_alloc & same_next & np.r_[is_alloc[1:], False]))
    prev_is_alloc = np.r_[False, is_alloc[:-1]] & np.r_[False, addr[1:] == addr[:-1]]
    orphan_free = ~is_alloc & ~prev_is_alloc
    seq_alloc = np.concatenate([seq[is_alloc], np.full(int(orphan_free.sum()), MISSING)])
    seq_free = np.concatenate([alloc_free, seq[orphan_free]])
    chronological = np.argsort(np.where(seq_alloc == MISSING, seq_free, seq_alloc), kind="stable")
    seq_alloc, seq_free = seq_alloc[chronological], seq_free[chronological]
    known = np.where(seq_alloc == MISSING, seq_free, seq_alloc)  # the entry that describes the allocation

    def at(column: str, positions: np.ndarray) -> np.ndarray:
        values = events[column][np.where(positions == MISSING, 0, positions)]
        return np.where(positions == MISSING, MISSING, values)

    rows = len(known)
    return {
        "device": np.full(rows, device, dtype=np.int64), "addr": events["addr"][known],
        "requested_bytes": events["bytes"][known], "stream": events["stream"][known],
        "t_alloc_us": at("t_us", seq_alloc), "t_free_us": at("t_us", seq_free),
        "seq_alloc": seq_alloc, "seq_free": seq_free, "stack_id": events["stack_id"][known],
        "user_metadata": events["user_metadata"][known],
        "origin": np.where(seq_alloc == MISSING, ORIGIN_BEFORE, ORIGIN_TRACE).astype(np.int64),
    }, double_allocs
