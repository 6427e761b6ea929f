"""Read `torch.cuda.memory._dump_snapshot` pickles (torch 2.0 to 2.13, and the legacy bare list of segments).

Layouts handled, oldest first:
- a bare list of segment dicts (`torch.cuda.memory_snapshot()`), no history;
- torch 2.0: blocks carry `history` ([{addr, real_size, frames}]) and no `address`; no `time_us`;
- torch 2.1+: blocks carry `address` and `frames`; trace entries carry `time_us` and `frames`;
- later: `allocator_settings`, `external_annotations`, trace `compile_context` and `user_metadata`,
  expandable segments (`segment_map` / `segment_unmap`), `oom` entries with `device_free`.

Frames are shared objects in the pickle (the same dicts referenced by many entries), so stacks are interned
by the identity of their frame dicts, once, and each distinct stack is converted to tuples only once.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from analyzer.core.allocator_rules import round_sizes
from analyzer.core.printable import MAX_SHOWN
from analyzer.core.trace import SEEDED, TABLES, DeviceInfo, MemoryTrace, make_table
from analyzer.core.vocabulary import UNATTRIBUTED
from analyzer.errors import CorruptInput, ResourceLimit
from analyzer.ingest.columns import MAX_TOTAL_BYTES, MISSING, to_nullable
from analyzer.ingest.fields import plain_settings, text
from analyzer.ingest.limits import check_devices
from analyzer.ingest.safe_pickle import load_untrusted
from analyzer.ingest.snapshot_history import (
    ACTIONS,
    ALLOC_COLUMNS,
    ORIGIN_END,
    ORIGINS,
    DeviceHistory,
    StackInterner,
    read_device_history,
)
from analyzer.ingest.sniff import open_input

_SEGMENT_GROW = ("segment_alloc", "segment_map")
_HINT = "Dump it again with torch.cuda.memory._dump_snapshot() from an unmodified torch."


def read_snapshot(path: Path) -> MemoryTrace:
    """Load a snapshot file into a MemoryTrace."""
    with open_input(path) as stream:
        data = load_untrusted(stream, str(path))
    return snapshot_to_trace(data, str(path), consume=True)


def snapshot_to_trace(data: Any, path: str, consume: bool = False) -> MemoryTrace:
    """Convert an already-unpickled snapshot object (dict or legacy list) into a MemoryTrace.

    With `consume`, trace entries are released as they are read (the caller's object is emptied), which
    keeps memory near the size of the unpickled data on large files."""
    legacy_list = isinstance(data, list)
    if legacy_list:
        data = {"segments": data, "device_traces": []}
    if not isinstance(data, dict) or "segments" not in data:
        raise CorruptInput(path, f"a pickle of a {type(data).__name__} without 'segments' is not a CUDA memory snapshot", _HINT)
    try:
        return _Builder(data, path, legacy_list, consume).build()
    except CorruptInput:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError, IndexError) as error:
        raise CorruptInput(path, f"the snapshot has an unexpected layout ({type(error).__name__}: {str(error)[:120]})", _HINT) from None
    except RecursionError:
        raise ResourceLimit(path, "the snapshot is nested too deeply to be read", _HINT) from None


def _concat(parts: list[dict[str, np.ndarray]], columns: tuple[str, ...]) -> dict[str, np.ndarray]:
    return {c: np.concatenate([p[c] for p in parts]) if parts else np.zeros(0, dtype=np.int64) for c in columns}


def _int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{what} is {type(value).__name__}, not an integer")
    return int(value)


def _size(value: Any, what: str) -> int:
    """A byte count: an integer from 0 to MAX_TOTAL_BYTES (a negative or larger one is corrupt, and would
    turn every total built on it into nonsense)."""
    size = _int(value, what)
    if not 0 <= size <= MAX_TOTAL_BYTES:
        raise ValueError(f"{what} is {size}, outside 0..{MAX_TOTAL_BYTES}")
    return size


class _Builder:
    def __init__(self, data: dict, path: str, legacy_list: bool, consume: bool) -> None:
        self.data, self.path, self.legacy_list, self.consume = data, path, legacy_list, consume
        self.stacks = StackInterner()
        self.settings, dropped = plain_settings(data.get("allocator_settings") or {})
        self.devices: dict[int, DeviceInfo] = {}
        self.warnings: list[str] = []
        if dropped:
            self.warnings.append(f"allocator_settings entries that are not plain values were ignored: "
                                 f"{', '.join(k[:40] for k in dropped[:5])}{' ...' if len(dropped) > 5 else ''}")
        self.unknown_actions: dict[str, int] = {}

    # ---- final state -------------------------------------------------------------------------------
    def _segments_and_blocks(self) -> tuple[dict[str, list], dict[str, list]]:
        seg: dict[str, list[Any]] = {k: [] for k in ("device", "addr", "bytes", "pool", "stream", "expandable")}
        blk: dict[str, list[Any]] = {k: [] for k in ("device", "segment_addr", "addr", "bytes", "requested_bytes",
                                                     "state", "stack_id")}
        segments = self.data["segments"]
        if not isinstance(segments, list):
            raise TypeError("'segments' is not a list")
        inconsistent = 0
        for s in segments:
            device = _int(s["device"], "segment device")
            address = _int(s["address"], "segment address")
            seg["device"].append(device)
            seg["addr"].append(address)
            seg["bytes"].append(_size(s["total_size"], "segment total_size"))
            seg["pool"].append(text(s.get("segment_type", "unknown"), "segment segment_type"))
            seg["stream"].append(_int(s.get("stream", 0), "segment stream"))
            seg["expandable"].append(bool(s.get("is_expandable", False)))
            self.devices.setdefault(device, DeviceInfo(device))
            blocks = s.get("blocks", ())
            active_sum = sum(_size(b["size"], "block size") for b in blocks if b.get("state") == "active_allocated")
            if "allocated_size" in s and active_sum != s["allocated_size"]:
                inconsistent += 1
            cursor = address
            for b in blocks:
                size = _size(b["size"], "block size")
                block_addr = _int(b["address"], "block address") if "address" in b else cursor  # 2.0: blocks tile in order
                cursor = block_addr + size
                history = b.get("history")
                frames = b.get("frames") if "frames" in b else (history[-1].get("frames") if history else None)
                blk["device"].append(device)
                blk["segment_addr"].append(address)
                blk["addr"].append(block_addr)
                blk["bytes"].append(size)
                blk["requested_bytes"].append(_size(b.get("requested_size", size), "block requested_size"))
                blk["state"].append(text(b["state"], "block state"))
                blk["stack_id"].append(self.stacks.intern(frames))
        if max(sum(seg["bytes"]), sum(blk["bytes"])) > MAX_TOTAL_BYTES:
            raise ValueError(f"segment or block sizes add up to more than {MAX_TOTAL_BYTES} bytes")
        if inconsistent:
            self.warnings.append(f"{inconsistent} segment(s) state an allocated_size that differs from the sum of their "
                                 "active blocks: the snapshot is inconsistent (edited or synthetic?); block sizes are used")
        blk["stack_id"] = to_nullable(np.asarray(blk["stack_id"], dtype=np.int64))
        return seg, blk

    # ---- history -----------------------------------------------------------------------------------
    def build(self) -> MemoryTrace:
        seg, blk = self._segments_and_blocks()
        traces = self.data.get("device_traces") or []
        if not isinstance(traces, list):
            raise TypeError("'device_traces' is not a list")
        check_devices(set(self.devices) | set(range(len(traces))), self.path)
        histories: list[DeviceHistory] = []
        metadata: dict[str, int] = {"": 0}  # user_metadata strings, interned: code -> string by position
        for device, trace in enumerate(traces):
            if not isinstance(trace, list):
                raise TypeError(f"device_traces[{device}] is not a list")
            self.devices.setdefault(device, DeviceInfo(device)).trace_entries = len(trace)
            histories.append(read_device_history(device, trace, self.stacks, metadata, self.consume))
        self._history_warnings(histories)
        if self.stacks.shortened:
            self.warnings.append(f"{self.stacks.shortened} frame file or function name(s) longer than {MAX_SHOWN} "
                                 "characters were shortened to their start and end")
        has_history = any(h.has_history for h in histories)
        allocations = self._allocations_table(_concat([h.allocs for h in histories], ALLOC_COLUMNS), blk, list(metadata))
        segments = self._segments_table(seg, [e for h in histories for e in h.segment_events])
        for device, info in self.devices.items():
            origin = allocations.loc[allocations["device"] == device, "origin"]
            info.history_truncated = bool(has_history and info.trace_entries and (origin != "trace").any())
        events = _concat([h.events for h in histories], tuple(TABLES["events"]))
        ooms = _concat([h.ooms for h in histories], tuple(TABLES["ooms"]))
        events["action"] = pd.Categorical.from_codes(events["action"], categories=ACTIONS)
        return MemoryTrace(
            source_path=self.path, source_kind="snapshot",
            allocations=allocations, segments=segments, blocks=make_table("blocks", blk),
            events=make_table("events", events), stacks=self.stacks.table(), annotations=self._annotations_table(),
            ooms=make_table("ooms", ooms), devices=dict(sorted(self.devices.items())),
            allocator_settings=self.settings, torch_era=self._torch_era(), has_history=has_history,
            has_segments=True, blocks_before=True, warnings=self.warnings,
            alive_before=("the ring buffer wrapped or recording started late", SEEDED),
        )

    def _history_warnings(self, histories: list[DeviceHistory]) -> None:
        for h in histories:
            if h.double_allocs:
                self.warnings.append(f"device {h.device}: {h.double_allocs} address(es) were allocated twice without "
                                     "a free in between; the history is damaged, each earlier allocation is taken "
                                     "to end at the next one")
            if h.unknown_actions:
                self.warnings.append(f"device {h.device}: trace entries with unknown actions were kept as 'other': "
                                     f"{h.unknown_actions}")

    def _allocations_table(self, al: dict[str, np.ndarray], blk: dict[str, Any], metadata: list[str]) -> pd.DataFrame:
        """Allocated bytes by the allocator's rounding, replaced by the final block size for allocations still
        alive at the end; then the blocks alive at the end whose alloc was never recorded."""
        requested = al["requested_bytes"]
        allocated = round_sizes(requested, self.settings)
        live_blocks = {(d, a): i for i, (d, a, s) in enumerate(zip(blk["device"], blk["addr"], blk["state"], strict=True))
                       if s == "active_allocated"}
        matched: set[tuple[int, int]] = set()
        for i in np.flatnonzero(al["seq_free"] == MISSING):
            key = (int(al["device"][i]), int(al["addr"][i]))
            block = live_blocks.get(key)
            if block is not None and blk["requested_bytes"][block] == requested[i]:
                allocated[i] = blk["bytes"][block]  # exact: the allocator's own block size
                matched.add(key)
        seeded = [i for key, i in live_blocks.items() if key not in matched]
        block_stacks = blk["stack_id"].to_numpy(dtype=np.int64, na_value=MISSING)
        n = len(seeded)
        extra = {
            "device": [blk["device"][i] for i in seeded], "addr": [blk["addr"][i] for i in seeded],
            "requested_bytes": [blk["requested_bytes"][i] for i in seeded], "stream": [0] * n,
            "t_alloc_us": [MISSING] * n, "t_free_us": [MISSING] * n, "seq_alloc": [MISSING] * n,
            "seq_free": [MISSING] * n, "stack_id": [int(block_stacks[i]) for i in seeded], "origin": [ORIGIN_END] * n,
            "user_metadata": [0] * n,
        }
        out: dict[str, Any] = {k: np.concatenate([al[k], np.asarray(extra[k], dtype=np.int64)]) for k in ALLOC_COLUMNS}
        rows = len(out["addr"])
        out["origin"] = pd.Categorical.from_codes(out["origin"], categories=ORIGINS)
        out["user_metadata"] = pd.Categorical.from_codes(out["user_metadata"], categories=metadata)
        out["alloc_id"] = np.arange(rows, dtype=np.int64)
        out["allocated_bytes"] = np.concatenate([allocated, np.asarray([blk["bytes"][i] for i in seeded], dtype=np.int64)])
        unlabelled = pd.Categorical.from_codes(np.zeros(rows, dtype=np.int8), categories=[UNATTRIBUTED])
        out.update(module=unlabelled, phase=unlabelled, category=unlabelled, step=np.full(rows, MISSING),
                   label_source=pd.Categorical.from_codes(np.zeros(rows, dtype=np.int8), categories=["none"]),
                   confidence=np.zeros(rows))
        return make_table("allocations", out)

    def _segments_table(self, seg: dict, seg_events: list) -> pd.DataFrame:
        """Final segments (alive at the end) plus ranges reserved and released during the recording."""
        n_final = len(seg["addr"])
        columns = {**seg, "t_alloc_us": [None] * n_final, "t_free_us": [None] * n_final,
                   "seq_alloc": [None] * n_final, "seq_free": [None] * n_final, "alive_at_end": [True] * n_final}
        final_index = {(d, a): i for i, (d, a) in enumerate(zip(seg["device"], seg["addr"], strict=True))}
        open_ranges: dict[tuple[int, int], tuple] = {}
        for device, seq, t_us, action, addr, size, stream in seg_events:
            key = (device, addr)
            if action in _SEGMENT_GROW:
                open_ranges[key] = (seq, t_us, size, stream, action == "segment_map")
                continue
            start = open_ranges.pop(key, None)
            seq0, t0, size0, stream0, mapped = start if start else (None, None, size, stream, action == "segment_unmap")
            self._append_segment(columns, device, addr, size0, stream0, mapped, seq0, t0, seq, t_us)
        for (device, addr), (seq0, t0, *_) in open_ranges.items():  # still reserved at the end: a final segment
            i = final_index.get((device, addr))
            if i is not None and columns["seq_alloc"][i] is None:
                columns["seq_alloc"][i], columns["t_alloc_us"][i] = seq0, t0
        return make_table("segments", columns)

    @staticmethod
    def _append_segment(columns: dict, device: int, addr: int, size: int, stream: int, mapped: bool,
                        seq0: Any, t0: Any, seq1: int, t1: Any) -> None:
        for column, value in (("device", device), ("addr", addr), ("bytes", size), ("pool", "expandable" if mapped else "unknown"),
                              ("stream", stream), ("expandable", mapped), ("t_alloc_us", t0), ("t_free_us", t1),
                              ("seq_alloc", seq0), ("seq_free", seq1), ("alive_at_end", False)):
            columns[column].append(value)

    def _annotations_table(self) -> pd.DataFrame:
        """Pair START/END annotation entries by (device, name), innermost first."""
        columns: dict[str, list[Any]] = {k: [] for k in ("device", "name", "start_us", "end_us", "thread")}
        open_starts: dict[tuple[int, str], list[int]] = {}
        for a in self.data.get("external_annotations") or []:
            device = _int(a.get("device", 0), "annotation device")
            name = text(a.get("name", ""), "annotation name")
            stage = a.get("stage")
            t_us = a.get("time_us")
            if stage == "START":
                open_starts.setdefault((device, name), []).append(len(columns["name"]))
                for column, value in (("device", device), ("name", name), ("start_us", t_us), ("end_us", None), ("thread", None)):
                    columns[column].append(value)
            elif stage == "END":
                starts = open_starts.get((device, name))
                if starts:
                    columns["end_us"][starts.pop()] = t_us
                else:  # the START fell out of the ring buffer
                    for column, value in (("device", device), ("name", name), ("start_us", None), ("end_us", t_us), ("thread", None)):
                        columns[column].append(value)
        return make_table("annotations", columns)

    def _torch_era(self) -> str:
        """The torch release range the layout comes from, by the newest field present."""
        d = self.data
        if self.legacy_list:
            return "legacy torch.cuda.memory_snapshot() list"
        first = next((e for t in d.get("device_traces") or [] if isinstance(t, list) for e in t), None)
        if isinstance(first, dict) and "user_metadata" in first:
            return "torch>=2.10 (user_metadata)"
        if "external_annotations" in d:
            return "torch>=2.5 (external_annotations)"
        if "allocator_settings" in d:
            return "torch>=2.3 (allocator_settings)"
        first_block = next((b for s in d.get("segments") or [] for b in s.get("blocks", ())), None)
        if isinstance(first_block, dict) and "history" in first_block:
            return "torch 2.0 (block history)"
        return "torch 2.1-2.2"
