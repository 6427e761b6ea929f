"""Hypothesis strategies: valid recordings of every format, and the ways an input can be corrupted.

`allocator_runs` replays random requests through a small caching allocator (512-byte rounding, best-fit
blocks split and merged inside 2 MiB-aligned segments, empty segments released) and writes what torch 2.13
would dump: the trace (segment_alloc, alloc, free_requested, free_completed, segment_free) and the final
segments with their blocks. Its own bookkeeping gives the expected peak, independently of the analyzer.
`corrupt` then damages any JSON-like structure: deletes keys, swaps in values of the wrong type or range,
shuffles and duplicates list items.
"""
from __future__ import annotations

import copy
import json
import sqlite3
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hypothesis import strategies as st

MIB = 1 << 20
BASE = 0x7F0000000000
#: what a field may hold instead of what it should: every wrong type, and the edges of every range
HOSTILE_VALUES: list[Any] = [
    None, True, "", "x", "<script>alert(1)</script>", "\u0000\u202e", -1, 0, 2**63 - 1, 2**63, 2**64 + 1, -(2**63),
    10**30, 1.5, float("nan"), float("inf"), -0.0, [], [1, 2], {}, {"a": 1}, ("alloc",), b"\xff\xfe",
]
FRAMES = [
    [{"filename": "/home/u/model.py", "line": 10, "name": "forward"},
     {"filename": "/home/u/train.py", "line": 40, "name": "main"}],
    [{"filename": "/usr/lib/python3/site-packages/torch/optim/adam.py", "line": 99, "name": "step"},
     {"filename": "/home/u/train.py", "line": 44, "name": "main"}],
    [{"filename": "??", "line": 0, "name": "at::native::empty_cuda"}],
    [],
]


def _round(size: int) -> int:
    return max(512, -(-size // 512) * 512)


@dataclass
class _Segment:
    addr: int
    size: int
    blocks: list[list] = field(default_factory=list)  # [addr, size, requested or None when free, frames]


class _Allocator:
    """Just enough of the CUDA caching allocator to produce consistent traces for one device."""

    def __init__(self, device: int, next_addr: int) -> None:
        self.device, self.next_addr = device, next_addr
        self.segments: list[_Segment] = []
        self.trace: list[dict] = []
        self.live: list[list] = []  # blocks in use, in allocation order
        self.level = self.peak = 0
        self.time = 0

    def _event(self, action: str, addr: int, size: int, frames: list) -> None:
        self.time += 1
        self.trace.append({"action": action, "addr": addr, "size": size, "stream": 0, "time_us": self.time,
                           "frames": frames, "compile_context": "N/A", "user_metadata": ""})

    def alloc(self, size: int, frames: list) -> None:
        rounded = _round(size)
        fits = [(b[1], s, i) for s in self.segments for i, b in enumerate(s.blocks) if b[2] is None and b[1] >= rounded]
        if fits:
            _, segment, i = min(fits, key=lambda f: (f[0], f[1].addr, f[2]))
        else:
            segment = _Segment(self.next_addr, -(-rounded // (2 * MIB)) * 2 * MIB)
            segment.blocks.append([segment.addr, segment.size, None, []])
            self.next_addr += segment.size + 2 * MIB
            self.segments.append(segment)
            self._event("segment_alloc", segment.addr, segment.size, frames)
            i = 0
        block = segment.blocks[i]
        if block[1] > rounded:  # split: the rest stays free
            segment.blocks.insert(i + 1, [block[0] + rounded, block[1] - rounded, None, []])
            block[1] = rounded
        block[2], block[3] = size, frames
        self.live.append(block)
        self._event("alloc", block[0], size, frames)
        self.level += rounded
        self.peak = max(self.peak, self.level)

    def free(self, which: int) -> None:
        if not self.live:
            return
        block = self.live.pop(which % len(self.live))
        self._event("free_requested", block[0], block[2], block[3])
        self._event("free_completed", block[0], block[2], block[3])
        self.level -= block[1]
        block[2], block[3] = None, []
        segment = next(s for s in self.segments if s.addr <= block[0] < s.addr + s.size)
        merged: list[list] = []
        for b in segment.blocks:  # merge neighbouring free blocks
            if merged and merged[-1][2] is None and b[2] is None:
                merged[-1][1] += b[1]
            else:
                merged.append(b)
        segment.blocks = merged

    def release(self, which: int) -> None:
        empty = [s for s in self.segments if len(s.blocks) == 1 and s.blocks[0][2] is None]
        if empty:
            segment = empty[which % len(empty)]
            self.segments.remove(segment)
            self._event("segment_free", segment.addr, segment.size, [])

    def final_segments(self) -> list[dict]:
        return [{"device": self.device, "address": s.addr, "total_size": s.size,
                 "allocated_size": sum(b[1] for b in s.blocks if b[2] is not None),
                 "active_size": sum(b[1] for b in s.blocks if b[2] is not None),
                 "requested_size": sum(b[2] for b in s.blocks if b[2] is not None), "stream": 0,
                 "segment_type": "small" if s.size <= 2 * MIB else "large", "segment_pool_id": (0, 0),
                 "is_expandable": False, "frames": [],
                 "blocks": [{"address": b[0], "size": b[1], "requested_size": b[2] or 0,
                             "state": "inactive" if b[2] is None else "active_allocated", "frames": b[3]}
                            for b in s.blocks]} for s in self.segments]


@dataclass
class Run:
    """A generated snapshot and what its allocator knew: per device the peak of allocated bytes."""

    snapshot: dict
    peaks: dict[int, int]
    complete: bool  # False when the trace lost its oldest entries (a wrapped ring buffer)


_SIZES = st.one_of(st.integers(1, 4096), st.integers(4096, 3 * MIB), st.sampled_from([512, 1024, 2 * MIB, 20 * MIB]))
_OPS = st.tuples(st.sampled_from(["alloc", "alloc", "free", "release"]), st.integers(0, 1000), _SIZES,
                 st.integers(0, len(FRAMES) - 1))


@st.composite
def allocator_runs(draw: st.DrawFn, max_ops: int = 40) -> Run:
    devices = draw(st.integers(1, 2))
    frames_pool = copy.deepcopy(FRAMES)  # shared by the entries of this run (as in torch), never across runs
    segments, traces, peaks = [], [], {}
    for device in range(devices):
        allocator = _Allocator(device, BASE + device * (1 << 36))
        for op, which, size, frames in draw(st.lists(_OPS, max_size=max_ops)):
            if op == "alloc":
                allocator.alloc(size, frames_pool[frames])
            elif op == "free":
                allocator.free(which)
            else:
                allocator.release(which)
        segments += allocator.final_segments()
        traces.append(allocator.trace)
        peaks[device] = allocator.peak
    lost = draw(st.integers(0, 3))  # a wrapped ring buffer drops the oldest entries
    complete = lost == 0
    if not complete:
        traces = [t[min(lost, len(t)):] for t in traces]
    snapshot = {"segments": segments, "device_traces": traces, "external_annotations": [],
                "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": "", "expandable_segments": False}}
    return Run(snapshot, peaks, complete)


# ---- corruption ---------------------------------------------------------------------------------------------
def _containers(obj: Any) -> list[Any]:
    """Every dict and list inside `obj` (itself included), iteratively, each once: a duplicated container can
    end up inside itself, and a walk without a visited set would never end."""
    found, todo, seen = [], [obj], set()
    while todo:
        item = todo.pop()
        if isinstance(item, (dict, list)) and id(item) not in seen:
            seen.add(id(item))
            found.append(item)
            todo.extend(item.values() if isinstance(item, dict) else item)
    return found


def corrupt(draw: st.DrawFn, obj: Any, hostile: list[Any] | None = None) -> str:
    """Damage `obj` in place, once; returns what was done (for the failure message)."""
    containers = [c for c in _containers(obj) if c]
    if not containers:
        return "nothing to damage"
    target = draw(st.sampled_from(containers))
    keys = list(target) if isinstance(target, dict) else list(range(len(target)))
    key = draw(st.sampled_from(keys))
    how = draw(st.sampled_from(["delete", "replace", "replace", "shuffle", "duplicate"]))
    if how == "delete":
        del target[key]
    elif how == "replace":
        target[key] = draw(st.sampled_from(hostile or HOSTILE_VALUES))
    elif how == "shuffle" and isinstance(target, list):
        target[:] = draw(st.permutations(target))
    elif how == "duplicate" and isinstance(target, list):
        target.insert(key, target[key])
    else:
        target[key] = draw(st.sampled_from(hostile or HOSTILE_VALUES))
        how = "replace"
    return f"{how} {key!r}"


def flip_bytes(draw: st.DrawFn, data: bytes) -> bytes:
    """`data` with a few bytes overwritten, inserted or removed."""
    out = bytearray(data)
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, max(len(out) - 1, 0)))
        how = draw(st.sampled_from(["set", "insert", "delete"]))
        value = draw(st.integers(0, 255))
        if how == "set" and out:
            out[at] = value
        elif how == "insert":
            out.insert(at, value)
        elif out:
            del out[at]
    return bytes(out)


# ---- other formats ------------------------------------------------------------------------------------------
@st.composite
def chrome_traces(draw: st.DrawFn) -> dict:
    """A Kineto trace: [memory] events with consistent totals and addresses, a step, nested Python calls."""
    events, level, live, t = [], 0, [], 10.0
    for size, free in draw(st.lists(st.tuples(st.integers(1, 1 << 24), st.booleans()), max_size=20)):
        t += 1.0
        if free and live:
            addr, size = live.pop()
            level -= size
            nbytes = -size
        else:
            addr = 4096 * (len(events) + 1)
            live.append((addr, size))
            level += size
            nbytes = size
        events.append({"ph": "i", "cat": "cpu_instant_event", "s": "t", "name": "[memory]", "pid": 1, "tid": 1,
                       "ts": t, "args": {"Total Reserved": 1 << 40, "Total Allocated": level, "Bytes": nbytes,
                                         "Device Id": 0, "Device Type": 1,
                                         "Addr": addr}})
    events += [{"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "pid": 1, "tid": 1, "ts": 1.0,
                "dur": t + 10, "args": {"External id": 1}},
               {"ph": "X", "cat": "python_function", "name": "train.py(40): main", "pid": 1, "tid": 1, "ts": 2.0,
                "dur": t, "args": {"Python id": 1, "Python parent id": None}},
               {"ph": "X", "cat": "python_function", "name": "model.py(10): forward", "pid": 1, "tid": 1, "ts": 3.0,
                "dur": t - 2, "args": {"Python id": 2, "Python parent id": 1}}]
    return {"schemaVersion": 1, "deviceProperties": [{"id": 0, "name": "GPU", "totalGlobalMem": 80 << 30}],
            "traceEvents": draw(st.permutations(events)), "baseTimeNanoseconds": 1_700_000_000_000_000_000}


@st.composite
def memory_timelines(draw: st.DrawFn) -> list:
    """export_memory_timeline output: raw rows [t_ns, action, bytes, category], or the curve [times, sizes]."""
    if draw(st.booleans()):
        rows, live = [], []
        for t, size, category, free in draw(st.lists(st.tuples(st.integers(0, 10**12), st.integers(1, 1 << 30),
                                                                st.integers(0, 7), st.booleans()), max_size=20)):
            if free and live:
                size, category = live.pop()
                rows.append([t, 4, -size, category])
            else:
                live.append((size, category))
                rows.append([t, 2, size, category])
        return rows
    points = draw(st.lists(st.lists(st.integers(0, 1 << 34), min_size=8, max_size=8), min_size=1, max_size=12))
    return [list(range(1000, 1000 + len(points))), [[0, *p] for p in points]]


_NSYS_SCHEMA = """
CREATE TABLE StringIds (id INTEGER, value TEXT);
CREATE TABLE ENUM_CUDA_DEV_MEM_EVENT_OPER (id INTEGER, name TEXT);
CREATE TABLE ENUM_CUDA_MEM_KIND (id INTEGER, name TEXT);
CREATE TABLE ENUM_NSYS_EVENT_TYPE (id INTEGER, name TEXT);
CREATE TABLE TARGET_INFO_GPU (id INTEGER, name TEXT, totalMemory INTEGER);
CREATE TABLE TARGET_INFO_SESSION_START_TIME (utcEpochNs INTEGER);
CREATE TABLE CUDA_GPU_MEMORY_USAGE_EVENTS (start INTEGER, globalPid INTEGER, deviceId INTEGER, address INTEGER,
    bytes INTEGER, memKind INTEGER, memoryOperationType INTEGER);
CREATE TABLE NVTX_EVENTS (start INTEGER, "end" INTEGER, eventType INTEGER, text TEXT, globalTid INTEGER,
    textId INTEGER, domainId INTEGER);
INSERT INTO StringIds VALUES (1, 'train_step');
INSERT INTO ENUM_CUDA_DEV_MEM_EVENT_OPER VALUES (0, 'CUDA_DEV_MEM_EVENT_OPR_ALLOCATION'),
    (1, 'CUDA_DEV_MEM_EVENT_OPR_DEALLOCATION');
INSERT INTO ENUM_CUDA_MEM_KIND VALUES (1, 'CUDA_MEMOPR_MEMORY_KIND_DEVICE');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES (34, 'NvtxMark'), (59, 'NvtxPushPopRange');
INSERT INTO TARGET_INFO_GPU VALUES (0, 'GPU', 85899345920);
INSERT INTO TARGET_INFO_SESSION_START_TIME VALUES (1767225600000000000);
"""
_NSYS_VALUES = st.sampled_from([None, "x", -1, 0, 2**63 - 1, -(2**63), 1.5, 1e30, b"\xff", "<b>", 7])


@st.composite
def nsys_exports(draw: st.DrawFn) -> bytes:
    """A minimal Nsight Systems export: device memory rows (allocations, then their frees) and NVTX ranges,
    with a few cells swapped for hostile values when `corrupt` is drawn."""
    memory, nvtx = [], []
    sizes = draw(st.lists(st.integers(1, 1 << 34), max_size=8))
    for i, size in enumerate(sizes):
        memory.append([1000 * i, 4242 << 24, 0, BASE + i * (1 << 35), size, 1, 0])
    freed = draw(st.lists(st.integers(0, len(sizes) - 1), unique=True)) if sizes else []
    for i in freed:
        memory.append([1000 * (len(sizes) + i), 4242 << 24, 0, BASE + i * (1 << 35), sizes[i], 1, 1])
    for i, text in enumerate(draw(st.lists(st.text(max_size=30), max_size=4))):
        nvtx.append([10 * i, 10 * i + 5, 59, text, (4242 << 24) + 4242, None, None])
    if draw(st.booleans()):
        for _ in range(draw(st.integers(1, 3))):
            rows = draw(st.sampled_from([r for r in (memory, nvtx) if r] or [memory]))
            if rows:
                row = draw(st.sampled_from(rows))
                row[draw(st.integers(0, len(row) - 1))] = draw(_NSYS_VALUES)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "export.sqlite"
        db = sqlite3.connect(path)
        db.executescript(_NSYS_SCHEMA)
        db.executemany("INSERT INTO CUDA_GPU_MEMORY_USAGE_EVENTS VALUES (?, ?, ?, ?, ?, ?, ?)", memory)
        db.executemany("INSERT INTO NVTX_EVENTS VALUES (?, ?, ?, ?, ?, ?, ?)", nvtx)
        db.commit()
        db.close()
        return path.read_bytes()


def json_bytes(obj: Any) -> bytes:
    """JSON as torch writes it; NaN and Infinity (which Python writes and JSON lacks) stay in, as hostile bytes."""
    return json.dumps(obj, default=repr).encode("utf-8", "surrogatepass")
