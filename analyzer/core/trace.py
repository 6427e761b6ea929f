"""MemoryTrace: the one set of tables every reader fills and every analysis reads.

Sizes are int64 bytes and times int64 microseconds. Columns that can be missing use pandas' nullable
Int64. The column lists below are the documented pandas API (the README repeats them); the constructor
checks that each table has exactly its columns and that the invariants hold, so a reader bug fails loudly
where it happens rather than as a wrong number in a report.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from analyzer.core.timeline import build_timeline

#: one row per tensor-level allocation: an alloc paired with its free.
ALLOCATION_COLUMNS: dict[str, str] = {
    "alloc_id": "int64",          # position in this table
    "device": "int64",
    "addr": "int64",
    "requested_bytes": "int64",   # what the caller asked for
    "allocated_bytes": "int64",   # the block size the allocator handed out (what memory_allocated() counts)
    "stream": "int64",
    "t_alloc_us": "Int64",        # NA: allocated before recording started
    "t_free_us": "Int64",         # NA: alive at the end of the recording
    "seq_alloc": "Int64",         # index of the alloc entry in the device's trace; NA as above
    "seq_free": "Int64",          # index of the free entry (free_requested, else free_completed)
    "stack_id": "Int64",          # into `stacks`; NA when the allocation carries no frames
    "origin": "category",              # trace | before_trace (freed, alloc not recorded) | end_state (alive, alloc not recorded)
    "module": "category",              # labels: filled by analyzer.attribute; "unattributed" until then
    "phase": "category",
    "category": "category",
    "category_from_seq": "Int64",  # NA: `category` holds for the row's whole life; else the event from which it
                                   # holds, the row a `temporary` before it (a state's new value, made before the
                                   # old one is freed: both are live until then)
    "step": "Int64",
    "label_source": "category",        # which signal decided the labels
    "confidence": "float64",
    "user_metadata": "category",       # the allocator's user_metadata at the alloc (torch >= 2.10), "" when none
}

#: one row per reserved memory range (a cudaMalloc'd segment, or a mapped range of an expandable segment).
SEGMENT_COLUMNS: dict[str, str] = {
    "device": "int64",
    "addr": "int64",
    "bytes": "int64",
    "t_alloc_us": "Int64",
    "t_free_us": "Int64",
    "seq_alloc": "Int64",
    "seq_free": "Int64",
    "pool": "category",               # small | large | expandable-mapping (for segment_map ranges) | unknown
    "stream": "int64",
    "expandable": "bool",
    "alive_at_end": "bool",
}

#: one row per block of the final allocator state (the snapshot's `segments[*].blocks`).
BLOCK_COLUMNS: dict[str, str] = {
    "device": "int64",
    "segment_addr": "int64",
    "addr": "int64",
    "bytes": "int64",
    "requested_bytes": "int64",
    "state": "category",              # active_allocated | active_pending_free | inactive
    "stack_id": "Int64",
}

#: one row per raw allocator event, in recording order per device.
EVENT_COLUMNS: dict[str, str] = {
    "device": "int64",
    "seq": "int64",
    "t_us": "Int64",
    "action": "category",
    "addr": "int64",
    "bytes": "int64",
    "stream": "int64",
    "stack_id": "Int64",
}

#: one row per interned stack; frames are innermost first.
STACK_COLUMNS: dict[str, str] = {
    "stack_id": "int64",
    "frames": "object",          # tuple of (filename, line, function)
    "top_user_frame": "object",  # "file:line function" of the innermost Python frame of the user's code (not
                                 # torch's, the stdlib's or torch.compile's generated code; never a C/C++ frame),
                                 # or None (analyzer.core.stacks.top_user_frame)
    "op": "object",              # "aten::NAME": the operator the C++ frames say made it (stacks="all"), or None
                                 # (analyzer.core.stacks.stack_op)
}

#: one row per annotation range (record_function, Optimizer.step#..., FSDP, dynamo_timed ...).
ANNOTATION_COLUMNS: dict[str, str] = {
    "device": "int64",
    "name": "str",
    "start_us": "Int64",
    "end_us": "Int64",           # NA: still open at the end of the recording
    "thread": "Int64",
}

#: one row per out-of-memory event.
OOM_COLUMNS: dict[str, str] = {
    "device": "int64",
    "seq": "int64",
    "t_us": "Int64",
    "requested_bytes": "int64",  # the rounded size the allocator tried to get
    "device_free_bytes": "Int64",  # what cudaMemGetInfo said was free on the device
    "stack_id": "Int64",
}

TABLES: dict[str, dict[str, str]] = {
    "allocations": ALLOCATION_COLUMNS,
    "segments": SEGMENT_COLUMNS,
    "blocks": BLOCK_COLUMNS,
    "events": EVENT_COLUMNS,
    "stacks": STACK_COLUMNS,
    "annotations": ANNOTATION_COLUMNS,
    "ooms": OOM_COLUMNS,
}


def empty_table(name: str) -> pd.DataFrame:
    """A table with the documented columns and dtypes and no rows."""
    return pd.DataFrame({c: pd.Series(dtype=t) for c, t in TABLES[name].items()})


MISSING = -(2**63)  # readers may store this in nullable columns for NA (see analyzer.ingest.columns)


def _column(values: Any, dtype: str) -> Any:
    if dtype == "object":
        return pd.Series(values, dtype=object)
    if dtype == "Int64" and isinstance(values, np.ndarray) and values.dtype == np.int64:
        return pd.arrays.IntegerArray(values, values == MISSING)  # the readers' int64 columns: one pass, no copy
    column = pd.array(values, dtype=dtype)
    if dtype == "Int64" and len(column):
        column[(column == MISSING).fillna(False)] = pd.NA
    return column


#: columns a reader may leave out: they are filled with this value (formats that cannot carry them)
OPTIONAL_COLUMNS: dict[tuple[str, str], Any] = {("allocations", "user_metadata"): "",
                                                 ("allocations", "category_from_seq"): pd.NA}


def make_table(name: str, columns: dict[str, Any]) -> pd.DataFrame:
    """Build a table from column arrays, casting each to its documented dtype (MISSING becomes NA)."""
    spec = TABLES[name]
    rows = len(next(iter(columns.values()))) if columns else 0
    columns = {**{c: [v] * rows for (t, c), v in OPTIONAL_COLUMNS.items() if t == name and c not in columns}, **columns}
    missing = set(spec) - set(columns)
    extra = set(columns) - set(spec)
    if missing or extra:
        raise ValueError(f"table {name}: missing {sorted(missing)}, unexpected {sorted(extra)}")
    return pd.DataFrame({c: _column(columns[c], t) for c, t in spec.items()})


@dataclass
class DeviceInfo:
    """What the input says about one device, beyond the tables."""

    device: int
    trace_entries: int = 0
    history_truncated: bool = False     # frees with no alloc, or live blocks with no alloc, were seen
    capacity_bytes: int | None = None   # total device memory, where the input records it
    name: str | None = None
    api: str | None = None              # what drives a GPU that is not CUDA, as the input says ("ROCm/HIP")
    reserved_recorded: bool = True      # False: reserved bytes are only estimated (the running peak of allocated)
    before_recorded: bool = True        # False: what was alive before the first event is not known (a 2021
                                        # profiler trace carries no running total), so model states made before
                                        # it are not in the recording
    workspace_before_bytes: int | None = None  # a profiler trace's cuBLAS workspace, alive before it began: its own
                                               # `end_state` row, apart from the rest of what lived before


#: how a reader makes the rows of memory alive before its first event: from frees without allocs and the end state
SEEDED = "they are seeded from frees without allocs and from memory alive at the end"
#: why memory alive before the first event was missed, unless the reader says otherwise (MemoryTrace.alive_before)
PROFILED_LATE = ("the profiler started recording after they were allocated", SEEDED)


@dataclass
class MemoryTrace:
    """Every input, whatever its format, becomes these tables (see the column dicts above)."""

    source_path: str
    source_kind: str
    allocations: pd.DataFrame
    segments: pd.DataFrame
    blocks: pd.DataFrame
    events: pd.DataFrame
    stacks: pd.DataFrame
    annotations: pd.DataFrame
    ooms: pd.DataFrame
    devices: dict[int, DeviceInfo]
    allocator_settings: dict[str, Any] = field(default_factory=dict)
    torch_era: str = "unknown"
    has_history: bool = True            # False: the input holds only an end state
    # what the format records, as its reader says: the stages after ingest ask these, never the format's name
    has_segments: bool = False          # the allocator's segments and blocks (a snapshot), not only reserved totals
    blocks_before: bool = False         # rows from before the recording are the allocator's blocks (tensors), not
                                        # amounts that stand for whatever was alive
    records_categories: bool = False    # each row carries torch's own category (export_memory_timeline)
    # why memory was already alive at the first recorded event, and where its rows come from (None: a profiler
    # that started recording after they were allocated; the rows seeded: PROFILED_LATE)
    alive_before: tuple[str, str] | None = None
    warnings: list[str] = field(default_factory=list)
    # GPU activity for context (what ran at a peak), from inputs that record it (Nsight); None otherwise.
    # Columns: analyzer.ingest.nsys.GPU_ACTIVITY_COLUMNS (kind, device, stream, start_us, end_us, name, bytes).
    kernels: pd.DataFrame | None = None
    # Host-side spans (record_function ranges, nn.Module and Python calls, backward nodes) from profiler traces,
    # for attribution by time containment on a thread; None for other inputs.
    # Columns: analyzer.ingest.kineto.SPAN_COLUMNS (name, cat, start_us, end_us, thread, python_id, parent_id,
    # external_id).
    spans: pd.DataFrame | None = None
    # The thread that recorded each row of `events` (same index), where the input records it (Kineto); else None.
    event_threads: pd.Series | None = None
    rank: int | None = None             # distributed rank and world size, where the input records them
    world_size: int | None = None
    source_time_base_us: int = 0        # t_us minus this is the input's own clock (Kineto: baseTimeNanoseconds)
    grad_mode: str | None = None        # vocabulary.GradMode the recording shows (Kineto), None where it cannot say
    _timeline: pd.DataFrame | None = field(default=None, init=False, repr=False)  # built on first use

    def __post_init__(self) -> None:
        for name, spec in TABLES.items():
            table = getattr(self, name)
            if list(table.columns) != list(spec):
                raise ValueError(f"{name} columns {list(table.columns)} != documented {list(spec)}")
        self._check_invariants()

    def _check_invariants(self) -> None:
        a = self.allocations
        if len(a) and (a["requested_bytes"] < 0).any():
            raise ValueError("allocations: negative requested_bytes")
        if len(a) and (a["allocated_bytes"] < a["requested_bytes"]).any():
            raise ValueError("allocations: a block smaller than its request")
        if len(self.segments) and (self.segments["bytes"] < 0).any():
            raise ValueError("segments: negative size")

    @property
    def device_ids(self) -> list[int]:
        return sorted(self.devices)

    @property
    def timeline(self) -> pd.DataFrame:
        """Allocated, requested and reserved bytes after every event (see analyzer.core.timeline)."""
        if self._timeline is None:
            self._timeline = build_timeline(self)
        return self._timeline

    @property
    def time_origin_us(self) -> int | None:
        """The first recorded event time: reports show times relative to it."""
        times = self.events["t_us"].dropna()
        return int(times.min()) if len(times) else None

    def device_label(self, device: int) -> str:
        """`cuda:N` for a GPU (torch's index; `cuda:0 (ROCm/HIP)` where the input says HIP drives it); host memory
        (profiler CPU events are kept on device -1) by its recorded name."""
        info = self.devices.get(device)
        if device < 0:
            return (info.name if info else None) or "host"
        return f"cuda:{device} ({info.api})" if info is not None and info.api else f"cuda:{device}"

    def stack_frames(self, stack_id: Any) -> tuple:
        """Frames of one stack, innermost first; empty for NA."""
        if pd.isna(stack_id):
            return ()
        return self.stacks["frames"].iat[int(stack_id)]

    def end_state(self, device: int) -> dict[str, int]:
        """Allocated, requested, reserved and inactive bytes and the largest free block at the end."""
        blocks = self.blocks[self.blocks["device"] == device]
        live_segments = self.segments[(self.segments["device"] == device) & self.segments["alive_at_end"]]
        active = blocks["state"] == "active_allocated"
        inactive = blocks.loc[blocks["state"] == "inactive", "bytes"]
        return {
            "allocated_bytes": int(blocks.loc[active, "bytes"].sum()),
            "requested_bytes": int(blocks.loc[active, "requested_bytes"].sum()),
            "reserved_bytes": int(live_segments["bytes"].sum()),
            "inactive_bytes": int(inactive.sum()),
            "largest_free_block_bytes": int(inactive.max()) if len(inactive) else 0,
        }


@dataclass
class MultiRankTrace:
    """Several traces of one job (a directory or archive of per-rank profiler traces), one MemoryTrace each.

    Ranks stay separate because each rank numbers its own GPUs from 0; `traces` is ordered by rank (traces
    without distributedInfo last), then by file name.
    """

    source_path: str
    traces: list[MemoryTrace]
    warnings: list[str] = field(default_factory=list)

    @property
    def ranks(self) -> list[int | None]:
        return [t.rank for t in self.traces]
