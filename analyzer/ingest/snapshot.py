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

from analyzer.errors import CorruptInput
from analyzer.ingest.safe_pickle import load_untrusted
from analyzer.ingest.sniff import open_input
from analyzer.allocator_rules import round_size
from analyzer.stacks import top_user_frame
from analyzer.trace import UNATTRIBUTED, DeviceInfo, MemoryTrace, make_table

_FREE_ACTIONS = ("free_requested", "free_completed")
_SEGMENT_GROW = ("segment_alloc", "segment_map")
_SEGMENT_SHRINK = ("segment_free", "segment_unmap")
_HINT = "Dump it again with torch.cuda.memory._dump_snapshot() from an unmodified torch."


def read_snapshot(path: Path) -> MemoryTrace:
    """Load a snapshot file into a MemoryTrace."""
    with open_input(path) as stream:
        data = load_untrusted(stream, str(path))
    return snapshot_to_trace(data, str(path))


def snapshot_to_trace(data: Any, path: str) -> MemoryTrace:
    """Convert an already-unpickled snapshot object (dict or legacy list) into a MemoryTrace."""
    legacy_list = isinstance(data, list)
    if legacy_list:
        data = {"segments": data, "device_traces": []}
    if not isinstance(data, dict) or "segments" not in data:
        raise CorruptInput(path, f"a pickle of a {type(data).__name__} without 'segments' is not a CUDA memory snapshot", _HINT)
    try:
        return _Builder(data, path, legacy_list).build()
    except CorruptInput:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError, IndexError) as error:
        raise CorruptInput(path, f"the snapshot has an unexpected layout ({type(error).__name__}: {str(error)[:120]})", _HINT) from None


def _int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{what} is {type(value).__name__}, not an integer")
    return int(value)


class _StackInterner:
    """One id per distinct stack; frame dicts are shared in the pickle, so their ids identify a stack."""

    def __init__(self) -> None:
        self._by_list: dict[int, int] = {}
        self._by_frame_ids: dict[tuple[int, ...], int] = {}
        self._by_content: dict[tuple, int] = {}
        self._keepalive: list[Any] = []
        self.frames: list[tuple] = []

    def intern(self, frames: Any) -> int | None:
        if not frames:
            return None
        sid = self._by_list.get(id(frames))
        if sid is not None:
            return sid
        key = tuple(map(id, frames))
        sid = self._by_frame_ids.get(key)
        if sid is None:
            content = tuple((str(f.get("filename", "??")), int(f.get("line", 0) or 0), str(f.get("name", "??")))
                            for f in frames)
            sid = self._by_content.get(content)
            if sid is None:
                sid = len(self.frames)
                self.frames.append(content)
                self._by_content[content] = sid
            self._by_frame_ids[key] = sid
        self._by_list[id(frames)] = sid
        self._keepalive.append(frames)  # ids stay unique only while the objects live
        return sid

    def table(self) -> pd.DataFrame:
        return make_table("stacks", {
            "stack_id": np.arange(len(self.frames), dtype=np.int64),
            "frames": self.frames,
            "top_user_frame": [top_user_frame(f) for f in self.frames],
        })


class _Builder:
    def __init__(self, data: dict, path: str, legacy_list: bool) -> None:
        self.data, self.path, self.legacy_list = data, path, legacy_list
        self.stacks = _StackInterner()
        self.settings = data.get("allocator_settings") or {}
        if not isinstance(self.settings, dict):
            self.settings = {}
        self.devices: dict[int, DeviceInfo] = {}
        self.warnings: list[str] = []

    # ---- final state -------------------------------------------------------------------------------
    def _segments_and_blocks(self) -> tuple[dict[str, list], dict[str, list]]:
        seg = {k: [] for k in ("device", "addr", "bytes", "pool", "stream", "expandable")}
        blk = {k: [] for k in ("device", "segment_addr", "addr", "bytes", "requested_bytes", "state", "stack_id")}
        segments = self.data["segments"]
        if not isinstance(segments, list):
            raise TypeError("'segments' is not a list")
        inconsistent = 0
        for s in segments:
            device = _int(s["device"], "segment device")
            address = _int(s["address"], "segment address")
            total = _int(s["total_size"], "segment total_size")
            seg["device"].append(device)
            seg["addr"].append(address)
            seg["bytes"].append(total)
            seg["pool"].append(str(s.get("segment_type", "unknown")))
            seg["stream"].append(_int(s.get("stream", 0), "segment stream"))
            seg["expandable"].append(bool(s.get("is_expandable", False)))
            self.devices.setdefault(device, DeviceInfo(device))
            cursor = address
            active_sum = sum(_int(b["size"], "block size") for b in s.get("blocks", ()) if b.get("state") == "active_allocated")
            if "allocated_size" in s and active_sum != s["allocated_size"]:
                inconsistent += 1
            for b in s.get("blocks", ()):
                size = _int(b["size"], "block size")
                block_addr = _int(b["address"], "block address") if "address" in b else cursor  # 2.0: blocks tile in order
                cursor = block_addr + size
                history = b.get("history")
                frames = b.get("frames") if "frames" in b else (history[-1].get("frames") if history else None)
                blk["device"].append(device)
                blk["segment_addr"].append(address)
                blk["addr"].append(block_addr)
                blk["bytes"].append(size)
                blk["requested_bytes"].append(_int(b.get("requested_size", size), "block requested_size"))
                blk["state"].append(str(b["state"]))
                blk["stack_id"].append(self.stacks.intern(frames))
        if inconsistent:
            self.warnings.append(f"{inconsistent} segment(s) state an allocated_size that differs from the sum of their "
                                 "active blocks: the snapshot is inconsistent (edited or synthetic?); block sizes are used")
        return seg, blk

    # ---- history -----------------------------------------------------------------------------------
    def build(self) -> MemoryTrace:
        seg, blk = self._segments_and_blocks()
        traces = self.data.get("device_traces") or []
        if not isinstance(traces, list):
            raise TypeError("'device_traces' is not a list")
        ev = {k: [] for k in ("device", "seq", "t_us", "action", "addr", "bytes", "stream", "stack_id")}
        al = {k: [] for k in ("device", "addr", "requested_bytes", "stream", "t_alloc_us", "t_free_us",
                              "seq_alloc", "seq_free", "stack_id", "origin")}
        oom = {k: [] for k in ("device", "seq", "t_us", "requested_bytes", "device_free_bytes", "stack_id")}
        seg_events: list[tuple] = []
        has_history = False
        for device, trace in enumerate(traces):
            if not isinstance(trace, list):
                raise TypeError(f"device_traces[{device}] is not a list")
            info = self.devices.setdefault(device, DeviceInfo(device))
            info.trace_entries = len(trace)
            if trace:
                has_history |= self._replay_device(device, trace, ev, al, oom, seg_events)
        allocations = self._allocations_table(al, blk)
        segments = self._segments_table(seg, seg_events)
        annotations = self._annotations_table()
        events = make_table("events", ev)
        for device, info in self.devices.items():
            mine = allocations["device"] == device
            origin = allocations.loc[mine, "origin"]
            info.history_truncated = bool(has_history and info.trace_entries and (origin != "trace").any())
        blocks = make_table("blocks", blk)
        return MemoryTrace(
            source_path=self.path, source_kind="snapshot",
            allocations=allocations, segments=segments, blocks=blocks, events=events,
            stacks=self.stacks.table(), annotations=annotations, ooms=make_table("ooms", oom),
            devices=dict(sorted(self.devices.items())), allocator_settings=self.settings,
            torch_era=self._torch_era(), has_history=has_history, warnings=self.warnings,
        )

    def _replay_device(self, device: int, trace: list, ev: dict, al: dict, oom: dict, seg_events: list) -> bool:
        """Pair each alloc with its free in one pass; frees with no alloc were allocated before recording.

        Returns whether the trace holds any history (entries other than `snapshot` markers)."""
        open_by_addr: dict[int, int] = {}
        awaiting_completion: set[int] = set()
        intern = self.stacks.intern
        a_dev, a_addr, a_req, a_stream = al["device"], al["addr"], al["requested_bytes"], al["stream"]
        a_talloc, a_tfree, a_salloc, a_sfree, a_stack, a_origin = (al["t_alloc_us"], al["t_free_us"], al["seq_alloc"],
                                                                   al["seq_free"], al["stack_id"], al["origin"])
        e_seq, e_t, e_action, e_addr, e_bytes, e_stream, e_stack = (ev["seq"], ev["t_us"], ev["action"], ev["addr"],
                                                                    ev["bytes"], ev["stream"], ev["stack_id"])
        for seq, entry in enumerate(trace):
            action = entry["action"]
            addr = entry.get("addr", 0)
            size = entry["size"]
            stream = entry.get("stream", 0)
            t_us = entry.get("time_us")
            stack = intern(entry.get("frames"))
            e_seq.append(seq)
            e_t.append(t_us)
            e_action.append(action)
            e_addr.append(addr)
            e_bytes.append(size)
            e_stream.append(stream)
            e_stack.append(stack)
            if action == "alloc":
                previous = open_by_addr.get(addr)
                if previous is not None:
                    self.warnings.append(f"device {device}: address {addr:#x} allocated twice without a free (entry {seq})")
                    a_sfree[previous], a_tfree[previous] = seq, t_us
                open_by_addr[addr] = len(a_addr)
                a_dev.append(device); a_addr.append(addr); a_req.append(size); a_stream.append(stream)
                a_talloc.append(t_us); a_tfree.append(None); a_salloc.append(seq); a_sfree.append(None)
                a_stack.append(stack); a_origin.append("trace")
            elif action in _FREE_ACTIONS:
                if action == "free_completed" and addr in awaiting_completion:
                    awaiting_completion.discard(addr)
                    continue
                row = open_by_addr.pop(addr, None)
                if row is None:  # allocated before the (ring-buffered) history starts
                    a_dev.append(device); a_addr.append(addr); a_req.append(size); a_stream.append(stream)
                    a_talloc.append(None); a_tfree.append(t_us); a_salloc.append(None); a_sfree.append(seq)
                    a_stack.append(stack); a_origin.append("before_trace")
                else:
                    a_sfree[row], a_tfree[row] = seq, t_us
                if action == "free_requested":
                    awaiting_completion.add(addr)
            elif action in _SEGMENT_GROW or action in _SEGMENT_SHRINK:
                seg_events.append((device, seq, t_us, action, addr, size, stream))
            elif action == "oom":
                oom["device"].append(device); oom["seq"].append(seq); oom["t_us"].append(t_us)
                oom["requested_bytes"].append(size); oom["device_free_bytes"].append(entry.get("device_free"))
                oom["stack_id"].append(stack)
        ev["device"].extend([device] * len(trace))
        return any(action != "snapshot" for action in e_action[-len(trace):])

    def _allocations_table(self, al: dict, blk: dict) -> pd.DataFrame:
        """Add blocks alive at the end whose alloc was not recorded; use final block sizes where known."""
        live_blocks = {(d, a): i for i, (d, a, s) in enumerate(zip(blk["device"], blk["addr"], blk["state"]))
                       if s == "active_allocated"}
        n = len(al["addr"])
        allocated = [0] * n
        matched: set[tuple[int, int]] = set()
        for i in range(n):
            key = (al["device"][i], al["addr"][i])
            block = live_blocks.get(key) if al["seq_free"][i] is None else None
            if block is not None and blk["requested_bytes"][block] == al["requested_bytes"][i]:
                allocated[i] = blk["bytes"][block]  # exact: the allocator's own block size
                matched.add(key)
            else:
                allocated[i] = round_size(_int(al["requested_bytes"][i], "trace size"), self.settings)
        # blocks alive at the end with no alloc in the history (history off, ring buffer wrapped, late start)
        for key, i in live_blocks.items():
            if key in matched:
                continue
            for column, value in (("device", key[0]), ("addr", key[1]), ("requested_bytes", blk["requested_bytes"][i]),
                                  ("stream", 0), ("t_alloc_us", None), ("t_free_us", None), ("seq_alloc", None),
                                  ("seq_free", None), ("stack_id", blk["stack_id"][i]), ("origin", "end_state")):
                al[column].append(value)
            allocated.append(blk["bytes"][i])
        rows = len(al["addr"])
        al["alloc_id"] = np.arange(rows, dtype=np.int64)
        al["allocated_bytes"] = allocated
        unlabelled = [UNATTRIBUTED] * rows
        al.update(module=unlabelled, phase=unlabelled, category=unlabelled, label_source=["none"] * rows,
                  step=[None] * rows, confidence=np.zeros(rows))
        return make_table("allocations", al)

    def _segments_table(self, seg: dict, seg_events: list) -> pd.DataFrame:
        """Final segments (alive at the end) plus ranges reserved and released during the recording."""
        n_final = len(seg["addr"])
        columns = {**seg, "t_alloc_us": [None] * n_final, "t_free_us": [None] * n_final,
                   "seq_alloc": [None] * n_final, "seq_free": [None] * n_final, "alive_at_end": [True] * n_final}
        final_index = {(d, a): i for i, (d, a) in enumerate(zip(seg["device"], seg["addr"]))}
        open_ranges: dict[tuple[int, int], tuple] = {}
        for device, seq, t_us, action, addr, size, stream in seg_events:
            key = (device, addr)
            if action in _SEGMENT_GROW:
                open_ranges[key] = (seq, t_us, size, stream, action == "segment_map")
                continue
            start = open_ranges.pop(key, None)
            seq0, t0, size0, stream0, mapped = start if start else (None, None, size, stream, action == "segment_unmap")
            self._append_segment(columns, device, addr, size0, stream0, mapped, seq0, t0, seq, t_us)
        for (device, addr), (seq0, t0, size, stream, mapped) in open_ranges.items():
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
        columns = {k: [] for k in ("device", "name", "start_us", "end_us", "thread")}
        open_starts: dict[tuple[int, str], list[int]] = {}
        for a in self.data.get("external_annotations") or []:
            device = _int(a.get("device", 0), "annotation device")
            name = str(a.get("name", ""))
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
