"""Read `prof.export_memory_timeline(...)` files: raw events (`.raw.json.gz`) and per-category curves (`.json`).

Both come from torch/profiler/_memory_profiler.py (MemoryProfileTimeline), where torch itself has decided
the category of every tensor; those labels are kept (`label_source="torch_memory_profiler"`, confidence 1;
tensors torch could not classify stay "unattributed").

- raw (`export_memory_timeline_raw`): a JSON list of `[t_ns, action, bytes, category]` rows. Actions
  (Action enum values) 1 PREEXISTING (t = -1: alive before profiling), 2 CREATE, 3 INCREMENT_VERSION (written
  as two rows: -bytes in the old version's category, +bytes in the new one's: the same memory changing
  category, e.g. a gradient buffer being written), 4 DESTROY (-bytes). Times are epoch nanoseconds.
- curve (`export_memory_timeline`, `.json` / `.json.gz`): `[times_us, sizes]` where `sizes[i]` is
  `[0, bytes of category 0, ..., bytes of category 7]` after the events at `times[i]`; the first point holds
  the pre-existing tensors (its time is the earliest real one).

Category indices (`_CATEGORY_TO_INDEX`): 0 PARAMETER, 1 OPTIMIZER_STATE, 2 INPUT, 3 TEMPORARY, 4 ACTIVATION,
5 GRADIENT, 6 AUTOGRAD_DETAIL, 7 None (unknown).

Neither form has addresses, threads, stacks or a device: raw frees are paired with the latest open row of
the same size and category (HistoryBuilder with BySize: every per-category total is exact at every event);
curve changes become one allocation or free per category and point (frees first within a point, so no
replayed value exceeds the curve), paired as a pile. The file is reported as device 0, requested = allocated
= the tensor's storage bytes, and reserved bytes are estimated as the running peak of allocated bytes.
"""
from __future__ import annotations

from itertools import chain
from pathlib import Path
from typing import Any

import numpy as np

from analyzer.core.trace import DeviceInfo, MemoryTrace, empty_table
from analyzer.core.vocabulary import TORCH_PROFILER_LABEL_SOURCE, UNATTRIBUTED
from analyzer.errors import CorruptInput
from analyzer.ingest import sniff
from analyzer.ingest.columns import MAX_TOTAL_BYTES
from analyzer.ingest.history import BySize, HistoryBuilder, Pile
from analyzer.ingest.json_depth import DepthLimitedStream
from analyzer.ingest.json_stream import first_byte, ijson_backend, reading

#: torch's category index -> our category name
CATEGORIES = ("parameter", "optimizer_state", "input", "temporary", "activation", "gradient", "autograd_detail",
              UNATTRIBUTED)
#: torch's categories that are not ours, as ours: AUTOGRAD_DETAIL (intermediate gradients) is a temporary
PREEXISTING, CREATE, INCREMENT_VERSION, DESTROY = 1, 2, 3, 4
DEVICE = 0
_HINT = "Export it again with prof.export_memory_timeline(path) from a profile recorded with profile_memory=True."


def read_memory_timeline(path: Path) -> MemoryTrace:
    """Load either form; which one it is is told by the content (a raw row is four numbers)."""
    name = str(path)
    with sniff.open_input(path) as stream, reading(name, _HINT):
        if first_byte(stream) != b"[":
            raise CorruptInput(name, "the top level is not a JSON list, so this is not a memory timeline", _HINT)
        backend, warnings = ijson_backend()
        items = backend.items(DepthLimitedStream(stream, name), "item", use_float=True)
        first, second = next(items, None), next(items, None)
        if isinstance(second, list) and second and isinstance(second[0], list):
            return _curve_trace(name, first, second, warnings)
        rows = chain((r for r in (first, second) if r is not None), items)
        return _raw_trace(name, rows, warnings)


def _raw_trace(name: str, rows: Any, warnings: list[str]) -> MemoryTrace:
    """Raw rows in time order (PREEXISTING first) through the shared replay."""
    t_ns, action, nbytes, category = _raw_columns(rows)
    builder = HistoryBuilder()
    builder.start_device(DEVICE, BySize)
    order = np.argsort(t_ns, kind="stable")
    for t, a, b, c in zip((t_ns[order] // 1000).tolist(), action[order].tolist(), nbytes[order].tolist(),
                          category[order].tolist(), strict=True):
        label = CATEGORIES[c]
        if a == PREEXISTING:
            builder.seed(b, label)
        elif b > 0:
            builder.alloc(t, b, category=label, action="alloc" if a == CREATE else "increment_version")
        elif b < 0:
            builder.free(t, -b, category=label, action="free_completed" if a == DESTROY else "increment_version")
    builder.finish_device()
    notes = ["the raw memory timeline has no addresses: frees are paired with the latest open tensor of the same "
             "size and category"]
    return _trace(name, "memory_timeline_raw", builder, warnings + notes, has_history=bool(len(t_ns)))


def _raw_columns(rows: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(t_ns, action, signed bytes, category index) arrays, checked against the enums."""
    table = np.array([(int(t), int(a), int(b), int(c)) for t, a, b, c in rows], dtype=np.int64).reshape(-1, 4)
    t_ns, action, nbytes, category = table.T
    actions = (PREEXISTING, CREATE, INCREMENT_VERSION, DESTROY)
    if not np.isin(action, actions).all():
        raise ValueError(f"unknown actions {sorted(set(action.tolist()) - set(actions))}")
    if ((action <= CREATE) & (nbytes < 0) | (action == DESTROY) & (nbytes > 0)).any():
        raise ValueError("a PREEXISTING or CREATE row frees bytes, or a DESTROY row adds them")
    if ((category < 0) | (category >= len(CATEGORIES))).any():
        raise ValueError(f"category indices outside 0..{len(CATEGORIES) - 1}")
    if np.abs(nbytes.astype(np.float64)).sum() > MAX_TOTAL_BYTES:
        raise ValueError(f"sizes add up to more than {MAX_TOTAL_BYTES} bytes")
    return t_ns, action, nbytes, category


def _curve_trace(name: str, times: Any, sizes: list, warnings: list[str]) -> MemoryTrace:
    """Per-category changes between consecutive points, frees before allocations."""
    levels = np.array(sizes, dtype=np.int64)
    if not isinstance(times, list) or levels.ndim != 2 or levels.shape != (len(times), len(CATEGORIES) + 1):
        raise ValueError(f"expected [times, sizes] with {len(CATEGORIES) + 1} sizes per time")
    levels = levels[:, 1:]  # column 0 is never written by torch
    if (levels < 0).any() or levels.astype(np.float64).sum(axis=1).max(initial=0) > MAX_TOTAL_BYTES:
        raise ValueError(f"category sizes must not be negative nor add up to more than {MAX_TOTAL_BYTES} bytes")
    t_us = np.array(times, dtype=np.int64)
    builder = HistoryBuilder()
    builder.start_device(DEVICE, Pile)
    for c, b in enumerate(levels[0].tolist() if len(levels) else []):
        if b > 0:
            builder.seed(b, CATEGORIES[c])
    for i in range(1, len(levels)):
        change = (levels[i] - levels[i - 1]).tolist()
        t = int(t_us[i])
        for c in np.argsort(change, kind="stable").tolist():  # frees (negative) first
            if change[c] < 0:
                builder.free(t, -change[c], category=CATEGORIES[c])
            elif change[c] > 0:
                builder.alloc(t, change[c], category=CATEGORIES[c])
    builder.finish_device()
    notes = ["the memory timeline curve holds only per-category totals: each change is one synthetic allocation "
             "or free, so totals are exact but tensor counts and lifetimes are not"]
    return _trace(name, "memory_timeline", builder, warnings + notes, has_history=len(levels) > 1)


def _trace(name: str, kind: str, builder: HistoryBuilder, warnings: list[str], has_history: bool) -> MemoryTrace:
    tables = builder.tables(label_source=TORCH_PROFILER_LABEL_SOURCE)
    notes = [f"export_memory_timeline files do not name their device: shown as device {DEVICE}",
             "no reserved bytes recorded; reserved is estimated as the running peak of allocated bytes (a lower bound)"]
    return MemoryTrace(
        source_path=name, source_kind=kind, allocations=tables["allocations"], segments=tables["segments"],
        blocks=empty_table("blocks"), events=tables["events"], stacks=empty_table("stacks"),
        annotations=empty_table("annotations"), ooms=tables["ooms"],
        devices={DEVICE: DeviceInfo(DEVICE, trace_entries=len(tables["events"]),
                                    history_truncated=DEVICE in tables["truncated"], reserved_recorded=False)},
        torch_era="torch.profiler export_memory_timeline", has_history=has_history, records_categories=True,
        alive_before=("torch's memory profiler lists them as existing before the profiled steps",
                      "their categories are torch's"),
        warnings=warnings + builder.warnings + notes, event_threads=tables["event_threads"],
    )
