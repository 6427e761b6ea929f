"""Hand-made snapshots: a few allocations, segments, annotations and an OOM, written as they happen.

    rec = Recording()
    with rec.step(1), rec.phase("forward"):
        x = rec.alloc(64 * MiB)
    rec.oom(1 * GiB, device_free=0)
    trace = rec.trace()                    # a MemoryTrace, as analyzer.ingest.snapshot reads the dict

Each allocation gets its own segment unless `segment=` puts it in one made with `reserve`; `free` keeps the
segment cached unless `release=True` (then it is handed back, as `torch.cuda.empty_cache` or an OOM retry
would). The end state (`segments` with their blocks) is written from what is still alive, so the history and
the end state agree.
"""
from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from analyzer.core.trace import MemoryTrace
from analyzer.ingest.snapshot import snapshot_to_trace

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
BLOCK = 512   # every block the caching allocator hands out is a multiple of this (a request is rounded up)
BASE = 0x7F0000000000
USER = [{"filename": "train.py", "line": 20, "name": "train_step"}]


def frames(where: str = "train.py:20", name: str = "train_step") -> list[dict[str, Any]]:
    """Frames of a user line 'file.py:LINE' (innermost), called from train.py:20."""
    filename, line = where.rsplit(":", 1)
    top = [{"filename": filename, "line": int(line), "name": name}]
    return top if top[0] == USER[0] else top + USER


class Recording:
    """One device's allocator history, built call by call (time advances 10 µs an entry)."""

    def __init__(self, device: int = 0) -> None:
        self.device = device
        self.t = 1_000
        self.entries: list[dict[str, Any]] = []
        self.annotations: list[dict[str, Any]] = []
        self.segments: dict[int, int] = {}                          # live segment address -> size
        self.blocks: dict[int, tuple[int, int, list[dict]]] = {}    # live block address -> (size, segment, frames)
        self._next = BASE

    # ---- allocator actions ---------------------------------------------------------------------------------
    def _entry(self, action: str, addr: int, size: int, stack: list[dict] | None = None, **extra: Any) -> None:
        self.t += 10
        self.entries.append({"action": action, "addr": addr, "size": size, "stream": 0, "time_us": self.t,
                             "frames": USER if stack is None else stack, **extra})

    def reserve(self, size: int) -> int:
        """A new segment of `size` bytes (cudaMalloc), empty; returns its address."""
        addr = self._next
        self._next += -(-size // (2 * MiB)) * 2 * MiB + 2 * MiB   # apart, so no two segments touch
        self.segments[addr] = size
        self._entry("segment_alloc", addr, size)
        return addr

    def alloc(self, size: int, where: str = "train.py:20", segment: int | None = None, offset: int = 0,
              name: str = "train_step", with_frames: bool = True, native: tuple[str, ...] = ()) -> int:
        """A tensor of `size` bytes made at the line `where` in function `name` (no Python frames, as on
        autograd's thread, with `with_frames=False`; C++ frames named `native` innermost, as `stacks="all"`
        records them): in a new segment of its own size, or at `offset` in `segment`. Returns its address."""
        assert size > 0 and size % BLOCK == 0, f"{size} bytes: blocks are multiples of {BLOCK} bytes"
        if segment is None:
            segment = self.reserve(size)
        addr = segment + offset
        stack = [{"filename": "??", "line": 0, "name": f} for f in native] + (frames(where, name) if with_frames else [])
        self.blocks[addr] = (size, segment, stack)
        self._entry("alloc", addr, size, stack)
        return addr

    def free(self, addr: int, release: bool = False) -> None:
        size, segment, stack = self.blocks.pop(addr)
        self._entry("free_requested", addr, size, stack)
        self._entry("free_completed", addr, size, stack)
        if release:
            self.release(segment)

    def forget_history(self) -> None:
        """Start the recording here, as `_record_memory_history` called late would: what is alive stays in the
        end state, without the frames of allocations the history never saw."""
        self.entries.clear()
        self.annotations.clear()
        self.blocks = {addr: (size, segment, []) for addr, (size, segment, _) in self.blocks.items()}

    def release(self, segment: int) -> None:
        """Hand an empty segment back to the device (cudaFree)."""
        assert not any(s == segment for _, s, _ in self.blocks.values()), "the segment still holds tensors"
        self._entry("segment_free", segment, self.segments.pop(segment))

    def oom(self, size: int, device_free: int) -> None:
        """A request of `size` bytes the allocator could not serve, cudaMemGetInfo reporting `device_free`."""
        self._entry("oom", 0, size, device_free=device_free)

    @property
    def allocated(self) -> int:
        return sum(size for size, _, _ in self.blocks.values())

    @property
    def reserved(self) -> int:
        return sum(self.segments.values())

    # ---- annotations ---------------------------------------------------------------------------------------
    @contextmanager
    def range(self, name: str) -> Iterator[None]:
        """A record_function range around what the block records."""
        self.annotations.append({"device": self.device, "name": name, "stage": "START", "time_us": self.t + 1})
        yield
        self.t += 10
        self.annotations.append({"device": self.device, "name": name, "stage": "END", "time_us": self.t})

    def step(self, n: int) -> Any:
        return self.range(f"ProfilerStep#{n}")

    def phase(self, name: str) -> Any:
        """forward, backward, optimizer, load, ... (an `analyzer.phase` tag)."""
        return self.range(f"phase::{name}")

    # ---- output --------------------------------------------------------------------------------------------
    def snapshot(self, expandable_segments: bool = False) -> dict[str, Any]:
        """The snapshot dict torch.cuda.memory._snapshot() would return at this moment."""
        segments = []
        for addr, size in sorted(self.segments.items()):
            blocks, at = [], addr
            for b, (b_size, _, stack) in sorted((b, v) for b, v in self.blocks.items() if v[1] == addr):
                if b > at:
                    blocks.append({"address": at, "size": b - at, "requested_size": 0, "state": "inactive"})
                blocks.append({"address": b, "size": b_size, "requested_size": b_size, "state": "active_allocated",
                               "frames": stack})
                at = b + b_size
            if at < addr + size:
                blocks.append({"address": at, "size": addr + size - at, "requested_size": 0, "state": "inactive"})
            segments.append({"device": self.device, "address": addr, "total_size": size, "stream": 0,
                             "segment_type": "large", "blocks": blocks})
        traces: list[list[dict[str, Any]]] = [[] for _ in range(self.device)] + [list(self.entries)]
        return {"segments": segments, "device_traces": traces,
                "external_annotations": sorted(self.annotations, key=lambda a: a["time_us"]),
                "allocator_settings": {"expandable_segments": expandable_segments}}

    def trace(self, name: str = "hand-made", **settings: Any) -> MemoryTrace:
        return snapshot_to_trace(self.snapshot(**settings), name)

    def device_usage(self, outside: int) -> MemoryTrace:
        """What a recorder that sees every cudaMalloc of the process (Nsight) would show of this run: the same
        segments, plus `outside` bytes another library took before the first entry and kept to the end."""
        snapshot = copy.deepcopy(self.snapshot())
        addr = BASE // 2   # far from the allocator's segments
        entries = snapshot["device_traces"][self.device]
        first = entries[0]["time_us"] if entries else self.t
        entries.insert(0, {"action": "segment_alloc", "addr": addr, "size": outside, "stream": 0,
                           "time_us": first - 5, "frames": []})
        snapshot["segments"].append({"device": self.device, "address": addr, "total_size": outside, "stream": 0,
                                     "segment_type": "large", "blocks": [{"address": addr, "size": outside,
                                                                          "requested_size": 0, "state": "inactive"}]})
        return snapshot_to_trace(snapshot, "device usage")
