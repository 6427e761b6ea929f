"""The replay engine that every event-stream reader feeds, so that pairing frees with allocations is written once.

Kineto `[memory]` events and `export_memory_timeline` files (raw rows and per-category curves) are all streams
of allocations and frees, told with more or less detail: addresses or none, reserved totals or none. Each
reader turns its format into `HistoryBuilder` calls in time order and picks how a free finds its allocation
(`ByAddress`, `BySize`, `Pile`); the builder keeps the rows, the synthetic segments of reserved bytes and the
shared tables they become.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from analyzer.core.trace import make_table
from analyzer.core.vocabulary import UNATTRIBUTED


class _Rows:
    """Allocation or segment rows under construction, one list per field."""

    FIELDS = ("device", "addr", "bytes", "t_alloc", "t_free", "seq_alloc", "seq_free", "stack", "category")

    def __init__(self) -> None:
        self.columns: dict[str, list] = {f: [] for f in self.FIELDS}

    def __len__(self) -> int:
        return len(self.columns["bytes"])

    def add(self, device: int, addr: int, nbytes: int, t: int | None, seq: int | None, stack: int | None,
            category: str) -> int:
        c = self.columns
        c["device"].append(device)
        c["addr"].append(addr)
        c["bytes"].append(nbytes)
        c["t_alloc"].append(t)
        c["t_free"].append(None)
        c["seq_alloc"].append(seq)
        c["seq_free"].append(None)
        c["stack"].append(stack)
        c["category"].append(category)
        return len(c["bytes"]) - 1

    def close(self, row: int, t: int | None, seq: int) -> None:
        self.columns["t_free"][row], self.columns["seq_free"][row] = t, seq

    def split(self, row: int, nbytes: int) -> int:
        """Cut `nbytes` off an open row into a new row with the same birth; the new row is returned."""
        for values in self.columns.values():
            values.append(values[row])
        self.columns["bytes"][row] -= nbytes
        self.columns["bytes"][-1] = nbytes
        return len(self) - 1


Pieces = list[tuple[int | None, int]]  # (open row or None for "allocated before the trace", bytes)


class ByAddress:
    """Frees name the address they release (Kineto since 2022): pair with the open row at that address."""

    def __init__(self) -> None:
        self._open: dict[int, int] = {}

    def add(self, row: int, addr: int, category: str, nbytes: int) -> int | None:
        """Open `row`; returns a row left open at the same address (its free was not recorded)."""
        previous = self._open.get(addr)
        self._open[addr] = row
        return previous

    def take(self, addr: int, category: str, nbytes: int, rows: _Rows) -> Pieces:
        row = self._open.get(addr)
        if row is None or rows.columns["bytes"][row] != nbytes:
            return [(None, nbytes)]  # allocated before the trace (or a size the allocation never had)
        del self._open[addr]
        return [(row, nbytes)]


class BySize:
    """No addresses (2021 Kineto, raw memory timelines): the most recent open row of equal size and category."""

    def __init__(self) -> None:
        self._open: dict[tuple[str, int], list[int]] = {}

    def add(self, row: int, addr: int, category: str, nbytes: int) -> None:
        self._open.setdefault((category, nbytes), []).append(row)

    def take(self, addr: int, category: str, nbytes: int, rows: _Rows) -> Pieces:
        stack = self._open.get((category, nbytes))
        return [(stack.pop(), nbytes)] if stack else [(None, nbytes)]


class Pile:
    """Totals only (reserved bytes, per-category curves): a shrink closes the newest rows of its category
    first and splits the last one, so every total stays exact while lifetimes are a guess."""

    def __init__(self) -> None:
        self._open: dict[str, list[int]] = {}

    def add(self, row: int, addr: int, category: str, nbytes: int) -> None:
        self._open.setdefault(category, []).append(row)

    def take(self, addr: int, category: str, nbytes: int, rows: _Rows) -> Pieces:
        pile, left = self._open.setdefault(category, []), nbytes
        pieces: Pieces = []
        while left and pile:
            top = pile[-1]
            size = rows.columns["bytes"][top]
            if size <= left:
                pieces.append((pile.pop(), size))
                left -= size
            else:
                pieces.append((rows.split(top, left), left))
                left = 0
        return pieces + [(None, left)] if left else pieces


class HistoryBuilder:
    """Replays memory records, one device after another, into rows of allocations, events, segments and ooms.

    Call `start_device`, then `seed` / `alloc` / `free` / `reserve` / `oom` in time order, then `finish_device`.
    Without `reserve` calls, reserved bytes are estimated as the running peak of allocated bytes.
    """

    def __init__(self) -> None:
        self.allocations, self.segments = _Rows(), _Rows()
        self.events: dict[str, list] = {k: [] for k in ("device", "seq", "t_us", "action", "addr", "bytes", "stack_id")}
        self.threads: list[int | None] = []
        self.ooms: dict[str, list] = {k: [] for k in ("device", "seq", "t_us", "requested_bytes", "device_free_bytes",
                                                      "stack_id")}
        self.warnings: list[str] = []
        self.set_apart = False   # the last finished device's known part has a row of its own

    # -- one device --
    def start_device(self, device: int, pairing: type[ByAddress] | type[BySize] | type[Pile]) -> None:
        """Begin `device`; `pairing` decides which open allocation a free releases."""
        self.device, self.seq = device, 0
        self._pairs = pairing()
        self._reserved_pile = Pile()
        self._reserved: int | None = None      # last Total Reserved seen; None: estimating
        self._reserved_start = 0
        self._level = self._peak = 0           # allocated bytes relative to the start, and their running peak
        self._first_row, self._first_segment = len(self.allocations), len(self.segments)
        self._reallocated = 0                  # allocations at an address whose free was not recorded

    def seed(self, nbytes: int, category: str = UNATTRIBUTED, addr: int = 0) -> None:
        """A block alive before the first event (PREEXISTING, or the first point of a curve)."""
        row = self.allocations.add(self.device, addr, nbytes, None, None, None, category)
        self._pairs.add(row, addr, category, nbytes)

    def alloc(self, t: int, nbytes: int, addr: int = 0, stack: int | None = None, thread: int | None = None,
              category: str = UNATTRIBUTED, action: str = "alloc") -> None:
        if self._reserved is None and self._level + nbytes > self._peak:
            self._segment(t, self._level + nbytes - self._peak, thread)
            self._peak = self._level + nbytes
        seq = self._event(t, action, addr, nbytes, stack, thread)
        row = self.allocations.add(self.device, addr, nbytes, t, seq, stack, category)
        left_open = self._pairs.add(row, addr, category, nbytes)
        if left_open is not None:
            self.allocations.close(left_open, t, seq)
            self._reallocated += 1
        self._level += nbytes

    def free(self, t: int, nbytes: int, addr: int = 0, stack: int | None = None, thread: int | None = None,
             category: str = UNATTRIBUTED, action: str = "free_completed") -> None:
        seq = self._event(t, action, addr, nbytes, stack, thread)
        for row, piece in self._pairs.take(addr, category, nbytes, self.allocations):
            if row is None:
                row = self.allocations.add(self.device, addr, piece, None, None, stack, category)
            self.allocations.close(row, t, seq)
        self._level -= nbytes

    def reserve(self, t: int, total: int, thread: int | None = None) -> None:
        """The device's reserved bytes after this point (Total Reserved); a change becomes a segment event."""
        if self._reserved is None:
            self._reserved = self._reserved_start = total
        elif total != self._reserved:
            self._segment(t, total - self._reserved, thread)
            self._reserved = total

    def oom(self, t: int, nbytes: int, stack: int | None = None, thread: int | None = None,
            device_free: int | None = None) -> None:
        seq = self._event(t, "oom", 0, nbytes, stack, thread)
        for column, value in zip(self.ooms, (self.device, seq, t, nbytes, device_free, stack), strict=True):
            self.ooms[column].append(value)

    def finish_device(self, allocated_before: int | None = None, known_part: int | None = None) -> int:
        """Close the device: bytes alive before the first event that no row explains become one `end_state`
        row (when the input states them), or two, where the reader knows a part of them (`known_part` bytes,
        when they hold that much: `set_apart` says so); the reserved bytes before the first event become one
        segment. Returns the allocated bytes before the first event."""
        columns = self.allocations.columns
        seeded = sum(b for b, s in zip(columns["bytes"][self._first_row:], columns["seq_alloc"][self._first_row:], strict=True)
                     if s is None)
        unexplained = 0 if allocated_before is None else allocated_before - seeded
        part = known_part if known_part and unexplained > known_part else 0
        self.set_apart = bool(part)
        if part:
            self.allocations.add(self.device, 0, part, None, None, None, UNATTRIBUTED)
            unexplained -= part
            seeded += part
        if unexplained > 0:
            self.allocations.add(self.device, 0, unexplained, None, None, None, UNATTRIBUTED)
        elif unexplained < 0:
            self.warnings.append(f"device {self.device}: frees of blocks allocated before the trace add up to "
                                 f"{-unexplained} bytes more than the trace says were allocated")
        if self._reallocated:
            self.warnings.append(f"device {self.device}: {self._reallocated} allocations reuse an address whose free "
                                 "was not recorded; the earlier block is taken as freed there")
        start = seeded + max(unexplained, 0)
        before = self._reserved_start if self._reserved is not None else start
        released = sum(b for b, s in zip(self.segments.columns["bytes"][self._first_segment:],
                                         self.segments.columns["seq_alloc"][self._first_segment:], strict=True) if s is None)
        if before - released > 0:
            self.segments.add(self.device, 0, before - released, None, None, None, "reserved")
        return start

    def _event(self, t: int | None, action: str, addr: int, nbytes: int, stack: int | None, thread: int | None) -> int:
        seq, e = self.seq, self.events
        e["device"].append(self.device)
        e["seq"].append(seq)
        e["t_us"].append(t)
        e["action"].append(action)
        e["addr"].append(addr)
        e["bytes"].append(nbytes)
        e["stack_id"].append(stack)
        self.threads.append(thread)
        self.seq = seq + 1
        return seq

    def _segment(self, t: int, change: int, thread: int | None) -> None:
        if change > 0:
            seq = self._event(t, "segment_alloc", 0, change, None, thread)
            opened = self.segments.add(self.device, 0, change, t, seq, None, "reserved")
            self._reserved_pile.add(opened, 0, "reserved", change)
            return
        seq = self._event(t, "segment_free", 0, -change, None, thread)
        for row, piece in self._reserved_pile.take(0, "reserved", -change, self.segments):
            if row is None:
                row = self.segments.add(self.device, 0, piece, None, None, None, "reserved")
            self.segments.close(row, t, seq)

    # -- tables --
    def tables(self, label_source: str = "none") -> dict[str, Any]:
        """allocations, events, segments, ooms, event_threads and truncated (devices with allocations whose
        birth was not recorded); rows whose category is known carry `label_source` and confidence 1."""
        a = self.allocations.columns
        n = len(self.allocations)
        born = np.array([s is not None for s in a["seq_alloc"]], dtype=bool)
        freed = np.array([s is not None for s in a["seq_free"]], dtype=bool)
        origin = np.where(born, "trace", np.where(freed, "before_trace", "end_state"))
        labelled = np.array([c != UNATTRIBUTED for c in a["category"]], dtype=bool)
        unlabelled = [UNATTRIBUTED] * n
        allocations = make_table("allocations", {
            "alloc_id": np.arange(n, dtype=np.int64), "device": a["device"], "addr": a["addr"],
            "requested_bytes": a["bytes"], "allocated_bytes": a["bytes"], "stream": np.zeros(n, dtype=np.int64),
            "t_alloc_us": a["t_alloc"], "t_free_us": a["t_free"], "seq_alloc": a["seq_alloc"],
            "seq_free": a["seq_free"], "stack_id": a["stack"], "origin": origin, "module": unlabelled,
            "phase": unlabelled, "category": a["category"], "step": [None] * n,
            "label_source": np.where(labelled, label_source, "none"), "confidence": labelled.astype(np.float64),
        })
        s = self.segments.columns
        m = len(self.segments)
        segments = make_table("segments", {
            "device": s["device"], "addr": s["addr"], "bytes": s["bytes"], "t_alloc_us": s["t_alloc"],
            "t_free_us": s["t_free"], "seq_alloc": s["seq_alloc"], "seq_free": s["seq_free"], "pool": ["unknown"] * m,
            "stream": np.zeros(m, dtype=np.int64), "expandable": np.zeros(m, dtype=bool),
            "alive_at_end": np.array([t is None for t in s["seq_free"]], dtype=bool),
        })
        events = make_table("events", {**self.events, "stream": np.zeros(len(self.threads), dtype=np.int64)})
        return {"allocations": allocations, "segments": segments, "events": events,
                "truncated": set(np.unique(np.asarray(a["device"])[~born]).tolist()),
                "ooms": make_table("ooms", self.ooms),
                "event_threads": pd.Series(pd.array(self.threads, dtype="Int64"), index=events.index, name="thread")}
