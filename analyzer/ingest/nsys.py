"""Read Nsight Systems SQLite exports (`nsys export --type sqlite`) into a MemoryTrace.

What each table becomes:
- `CUDA_GPU_MEMORY_USAGE_EVENTS` (recorded with `nsys profile --cuda-memory-usage=true`): every device-memory
  cudaMalloc/cudaFree of every traced process. Those are the caching allocator's *segments* (plus anything
  else that called cudaMalloc: NCCL, extensions), never tensors, so they fill `segments` and
  `segment_alloc`/`segment_free` `events`; the timeline's reserved bytes are then the device usage Nsight saw,
  and `allocations` stays empty (a warning says so).
- `NVTX_EVENTS`: ranges and marks -> `annotations`. Messages come from the `text` column (torch.cuda.nvtx,
  unregistered strings) or through `textId` -> `StringIds` (registered strings of the `nvtx` package);
  custom domains prefix the name as `domain:message`. emit_nvtx ranges (`aten::mm, seq = 7, sizes = ...`) are
  reduced to the op name, pyprof/DLProf dict markers to `mod.op` or their `funcStack`.
- `CUPTI_ACTIVITY_KIND_KERNEL` / `_MEMCPY` / `_MEMSET` -> `trace.kernels` (GPU_ACTIVITY_COLUMNS): context for
  what ran at a peak.
- `TARGET_INFO_GPU` -> DeviceInfo (name, totalMemory); `CUPTI_ACTIVITY_KIND_RUNTIME` -> counts of memory API
  calls (and failed ones) in the warnings; `ProcessStreams` -> a warning when the program died on an exception.

Every enum value is resolved through the export's own `ENUM_*` tables by symbol name; nothing numeric is
assumed. Exports made before those tables existed (nsys < 2023) still yield their NVTX ranges (rows with an
end time), but not marks, domain names or memory events, and a warning says to re-export with a newer nsys.
Tables and columns are looked up before use, so added columns, renamed metadata (`EXPORT_META_DATA`, later
`META_DATA_EXPORT`) and absent tables are tolerated.

Times: nsys stores nanoseconds since the capture started (or UTC epoch ns with `--ts-normalize=true`);
the MemoryTrace holds UTC epoch microseconds, the clock of snapshot `time_us`, by adding
`TARGET_INFO_SESSION_START_TIME.utcEpochNs` (and undoing any `--ts-shift`). Without a session start time they
stay relative to the capture start and a warning says so.

Thread ids: `globalTid` is NVIDIA's serialized GlobalId, `TID + PID * 2**24 + (VM and hardware ids) * 2**48`,
so TID = globalTid % 2**24 and PID = globalTid // 2**24 % 2**24 (`globalPid` holds the same without the TID).
The annotation `thread` column is the TID; its `device` is the device the process used most (by its kernels,
copies and memory events), or the lowest device when the process did no GPU work.
"""
from __future__ import annotations

import ast
import json
import re
import shlex
import sqlite3
from collections.abc import Iterable
from contextlib import closing
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from analyzer.core.trace import DeviceInfo, MemoryTrace, empty_table, make_table
from analyzer.core.vocabulary import RECORD_MEMORY_HINT
from analyzer.errors import CorruptInput, UnsupportedFormat
from analyzer.ingest.limits import check_devices

#: one row per GPU activity (`MemoryTrace.kernels`); times are epoch µs like every other table
GPU_ACTIVITY_COLUMNS: dict[str, str] = {
    "kind": "str",          # kernel | memcpy | memset
    "device": "int64",
    "stream": "Int64",
    "start_us": "Int64",
    "end_us": "Int64",
    "name": "str",          # kernel short name; memcpy direction label (ENUM_CUDA_MEMCPY_OPER); "memset"
    "bytes": "Int64",       # bytes copied or set; NA for kernels
}

#: CUDA API functions that reserve or release device memory (their `_vNNNN` suffix removed)
MEMORY_APIS = ("cudaMalloc", "cudaFree", "cudaMallocAsync", "cudaFreeAsync", "cuMemAlloc", "cuMemFree",
               "cuMemAllocAsync", "cuMemFreeAsync", "cuMemCreate", "cuMemRelease", "cuMemMap", "cuMemUnmap")

_TID_SPAN = 1 << 24
_EPOCH_NS_PER_US = 1000
_META_TABLES = ("META_DATA_EXPORT", "EXPORT_META_DATA")
_MEMORY_TABLE = "CUDA_GPU_MEMORY_USAGE_EVENTS"
# A database is taken for an nsys export when it has StringIds and one of these.
_NSYS_TABLES = (*_META_TABLES, "NVTX_EVENTS", "CUPTI_ACTIVITY_KIND_RUNTIME", "CUPTI_ACTIVITY_KIND_KERNEL",
                _MEMORY_TABLE, "TARGET_INFO_GPU", "TARGET_INFO_SESSION_START_TIME")
_RANGE_TYPES = {"NvtxPushPopRange", "NvtxStartEndRange", "NvtxtPushPopRange", "NvtxtStartEndRange"}
_MARK_TYPES = {"NvtxMark", "NvtxtMark"}
_DOMAIN_CREATE = "NvtxDomainCreate"
_DEVICE_MEMORY_KINDS = ("_DEVICE", "_DEVICE_STATIC", "_ARRAY")  # suffixes of ENUM_CUDA_MEM_KIND symbol names
_EMIT_NVTX = re.compile(r"(.+?), (?:stashed seq|seq|op_id|sizes|input_op_ids) ?=")
_API_VERSION = re.compile(r"_v\d+$")


def read_nsys(path: Path) -> MemoryTrace:
    """Load an Nsight Systems SQLite export into a MemoryTrace."""
    uri = Path(path).resolve().as_uri() + "?mode=ro&immutable=1"
    try:
        with closing(sqlite3.connect(uri, uri=True)) as db:
            return _Reader(_Export(db, str(path))).build()
    except (TypeError, ValueError, OverflowError) as error:  # NULL or text where the schema promises numbers
        raise CorruptInput(path, f"the export holds values its schema does not allow ({type(error).__name__}: "
                                 f"{str(error)[:120]})", "Export the report again with nsys export --type sqlite.") from None
    except sqlite3.DatabaseError as error:
        raise CorruptInput(path, f"the SQLite database is damaged or truncated ({error})",
                           "Export it again: nsys export --type sqlite --force-overwrite=true --output "
                           f"{shlex.quote(str(path))} REPORT.nsys-rep") from None


def decode_global_tid(global_tid: int) -> tuple[int, int]:
    """(PID, TID) from a serialized GlobalId, as NVIDIA's export documentation decodes it."""
    return global_tid // _TID_SPAN % _TID_SPAN, global_tid % _TID_SPAN


@lru_cache(maxsize=65536)
def annotation_name(message: str) -> str:
    """The name worth grouping by: emit_nvtx suffixes dropped, pyprof/DLProf dict markers reduced to their op."""
    emitted = _EMIT_NVTX.match(message)
    if emitted:
        return emitted.group(1)
    if message.startswith("{"):
        marker = _parse_marker(message)
        if isinstance(marker, dict):
            if marker.get("op"):
                return ".".join(str(p) for p in (marker.get("mod"), marker["op"]) if p)
            if marker.get("funcStack"):
                return str(marker["funcStack"])
    return message


def _parse_marker(text: str) -> Any:
    """pyprof writes Python dict reprs, DLProf configuration markers are JSON: try both, execute nothing."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        pass
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


class _Export:
    """One open export: which tables and columns it has, its enums, strings and clock."""

    def __init__(self, db: sqlite3.Connection, path: str) -> None:
        self.db, self.path = db, path
        # ordinary tables only: nsys writes no views (a view can be an endless recursive query, a hang on SELECT)
        # and no virtual tables (their module's code runs on every read)
        self.tables = {name for (name, sql) in db.execute("SELECT name, sql FROM sqlite_master WHERE type = 'table'")
                       if not str(sql or "").lstrip().upper().startswith("CREATE VIRTUAL")}
        self._columns: dict[str, set[str]] = {}

    def columns(self, table: str) -> set[str]:
        """The table's declared plain columns. `PRAGMA table_info` hides generated columns, yet a query that
        names one evaluates its expression on every row (`zeroblob(300 MB)` in a 40 KB file), so the columns come
        from `table_xinfo` and only those with hidden = 0 count: nsys writes no generated columns."""
        if table not in self._columns:
            self._columns[table] = ({row[1] for row in self.db.execute(f'PRAGMA table_xinfo("{table}")') if row[6] == 0}
                                    if table in self.tables else set())
        return self._columns[table]

    def has(self, table: str, *columns: str) -> bool:
        return table in self.tables and set(columns) <= self.columns(table)

    def select(self, table: str, alias: str, columns: Iterable[str]) -> str:
        """`alias."col" AS "col"` for each column, `NULL AS "col"` for those this schema version lacks."""
        have = self.columns(table)
        return ", ".join(f'{alias}."{c}" AS "{c}"' if c in have else f'NULL AS "{c}"' for c in columns)

    def frame(self, sql: str, ints: Iterable[str] = ()) -> pd.DataFrame:
        """Query into nullable dtypes, so 64-bit ids and epoch nanoseconds stay exact next to NULLs; `ints`
        are cast to Int64 even when a schema version made them all NULL."""
        rows = pd.read_sql_query(sql, self.db, dtype_backend="numpy_nullable")
        for column in ints:
            rows[column] = rows[column].astype("Int64")
        return rows

    def enum(self, table: str) -> dict[int, str]:
        """id -> symbol name of one ENUM_* table (the label where a version has no name); empty when absent."""
        if not self.has(table, "id"):
            return {}
        name = "name" if "name" in self.columns(table) else "label"
        return {int(i): str(n) for i, n in self.db.execute(f'SELECT id, "{name}" FROM "{table}"') if n is not None}

    def meta(self) -> dict[str, str]:
        table = next((t for t in _META_TABLES if self.has(t, "name", "value")), None)
        if table is None:
            return {}
        return {str(n): str(v) for n, v in self.db.execute(f'SELECT name, value FROM "{table}"')}


def _int_or_zero(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0


class _Reader:
    """Builds one MemoryTrace; every part reads only the tables it needs and warns about what is missing."""

    def __init__(self, export: _Export) -> None:
        self.x = export
        self.warnings: list[str] = []
        self._check_is_nsys()
        self.offset_ns = self._clock_offset_ns()
        self.devices = self._devices()
        self.api_calls, self.api_failures, self.first_api_failure_us = self._memory_api_calls()

    # ---- identity and clock ------------------------------------------------------------------------
    def _check_is_nsys(self) -> None:
        if not self.x.has("StringIds", "id", "value") or not any(t in self.x.tables for t in _NSYS_TABLES):
            shown = ", ".join(sorted(self.x.tables)[:6]) or "none"
            raise UnsupportedFormat(self.x.path, f"an SQLite database, but not an Nsight Systems export (its tables: {shown}; "
                                    "an export has StringIds with plain id and value columns, never generated ones)",
                                    "Pass the output of nsys export --type sqlite REPORT.nsys-rep.")

    def _clock_offset_ns(self) -> int:
        """What to add to an export timestamp to get UTC epoch nanoseconds."""
        meta = self.x.meta()
        shift = _int_or_zero(meta.get("EXPORT_PARAM_TIME_SHIFT"))
        if meta.get("EXPORT_PARAM_TIME_NORMALIZE", "").lower() == "true":
            return -shift
        start = None
        if self.x.has("TARGET_INFO_SESSION_START_TIME", "utcEpochNs"):
            row = self.x.db.execute("SELECT MIN(utcEpochNs) FROM TARGET_INFO_SESSION_START_TIME").fetchone()
            start = row[0] if row else None
        if start is None:
            self.warnings.append("the export has no session start time (TARGET_INFO_SESSION_START_TIME): times are "
                                 "microseconds since the capture started, so they cannot be lined up with a snapshot")
            return -shift
        return int(start) - shift

    def _us(self, ns: pd.Series) -> pd.array:
        """Export nanoseconds to epoch microseconds, NULL staying NA."""
        return pd.array((ns.astype("Int64") + self.offset_ns) // _EPOCH_NS_PER_US, dtype="Int64")

    # ---- devices -----------------------------------------------------------------------------------
    def _devices(self) -> dict[int, DeviceInfo]:
        if not self.x.has("TARGET_INFO_GPU", "id"):
            return {}
        gpus = self.x.frame(f"SELECT {self.x.select('TARGET_INFO_GPU', 'g', ('id', 'name', 'totalMemory'))} "
                            "FROM TARGET_INFO_GPU AS g ORDER BY g.id", ints=("id", "totalMemory"))
        devices: dict[int, DeviceInfo] = {}
        for gpu in gpus.itertuples(index=False):
            devices.setdefault(int(gpu.id), DeviceInfo(
                int(gpu.id), name=None if pd.isna(gpu.name) else str(gpu.name),
                capacity_bytes=None if pd.isna(gpu.totalMemory) else int(gpu.totalMemory)))
        return devices

    def _device_by_pid(self) -> dict[int, int]:
        """The device each process used most, from every table that ties a process to a device."""
        parts = [f'SELECT "globalPid" / {_TID_SPAN} % {_TID_SPAN} AS pid, "deviceId" AS device FROM "{t}"'
                 for t in ("CUPTI_ACTIVITY_KIND_KERNEL", "CUPTI_ACTIVITY_KIND_MEMCPY", "CUPTI_ACTIVITY_KIND_MEMSET",
                           _MEMORY_TABLE) if self.x.has(t, "globalPid", "deviceId")]
        if not parts:
            return {}
        rows = self.x.db.execute(f"SELECT pid, device, COUNT(*) AS n FROM ({' UNION ALL '.join(parts)}) "
                                 "WHERE pid IS NOT NULL AND device IS NOT NULL GROUP BY pid, device ORDER BY n, device DESC")
        return {int(pid): int(device) for pid, device, _ in rows}  # later rows (more events) win

    # ---- memory ------------------------------------------------------------------------------------
    def _memory(self) -> tuple[pd.DataFrame, pd.DataFrame]:
        """`segments` and `events` from the device-memory rows of CUDA_GPU_MEMORY_USAGE_EVENTS."""
        if not self.x.has(_MEMORY_TABLE, "start", "deviceId", "address", "bytes", "memoryOperationType"):
            self.warnings.append(self._no_memory_table_warning())
            return empty_table("segments"), empty_table("events")
        allocs, frees = self._memory_operations()
        if not allocs or not frees:
            self.warnings.append(f"{_MEMORY_TABLE} is present but the export has no ENUM_CUDA_DEV_MEM_EVENT_OPER table "
                                 "to tell allocations from frees, so device memory was not read; export the report "
                                 "again with a current nsys (nsys export --type sqlite)")
            return empty_table("segments"), empty_table("events")
        rows = self._device_memory_rows(allocs | frees)
        self._warn_shared_devices(rows)
        return _segments_and_events(rows, self._us(rows["start"]), rows["memoryOperationType"].isin(allocs).to_numpy(bool))

    def _memory_operations(self) -> tuple[set[int], set[int]]:
        """(allocation ids, free ids) of memoryOperationType, by their ENUM_CUDA_DEV_MEM_EVENT_OPER symbol names."""
        operations = self.x.enum("ENUM_CUDA_DEV_MEM_EVENT_OPER")
        frees = {i for i, n in operations.items() if n.upper().endswith("DEALLOCATION")}
        return {i for i, n in operations.items() if n.upper().endswith("ALLOCATION")} - frees, frees

    def _device_memory_rows(self, operations: set[int]) -> pd.DataFrame:
        """Rows of device-resident kinds (pinned and managed host memory are not the GPU's) with a known operation."""
        columns = ("start", "globalPid", "deviceId", "address", "bytes", "memKind", "memoryOperationType")
        rows = self.x.frame(f"SELECT {self.x.select(_MEMORY_TABLE, 'm', columns)} FROM {_MEMORY_TABLE} AS m "
                            "ORDER BY m.start, m.rowid", ints=columns)
        kinds = self.x.enum("ENUM_CUDA_MEM_KIND")
        if kinds and rows["memKind"].notna().any():
            device_kinds = [i for i, n in kinds.items() if n.upper().endswith(_DEVICE_MEMORY_KINDS)]
            rows = rows[rows["memKind"].isin(device_kinds).fillna(False).astype(bool)]
        known = rows["memoryOperationType"].isin(operations).fillna(False).astype(bool)
        if not known.all():
            self.warnings.append(f"{int((~known).sum())} rows of {_MEMORY_TABLE} have an operation type that is neither "
                                 "an allocation nor a free in ENUM_CUDA_DEV_MEM_EVENT_OPER and were skipped")
        return rows[known]

    def _warn_shared_devices(self, rows: pd.DataFrame) -> None:
        processes = rows.groupby("deviceId")["globalPid"].nunique()
        for device, count in processes[processes > 1].items():
            self.warnings.append(f"device {device}: memory events of {count} processes are summed, so the timeline is "
                                 "the device's usage by all of them, not one process's")

    def _memory_api_calls(self) -> tuple[dict[str, int], dict[str, int], int | None]:
        """Calls of each MEMORY_APIS function, failed calls of each, and when the first one failed (epoch µs).

        Grouped in SQL by function name, so a trace of millions of API calls stays a handful of rows here."""
        table = "CUPTI_ACTIVITY_KIND_RUNTIME"
        if not self.x.has(table, "nameId", "start", "returnValue"):
            return {}, {}, None
        calls: dict[str, int] = {}
        failed: dict[str, int] = {}
        first_failure = None
        for name, n, n_failed, first in self.x.db.execute(
                f"SELECT s.value, COUNT(*), SUM(r.returnValue != 0), MIN(CASE WHEN r.returnValue != 0 THEN r.start END) "
                f"FROM {table} AS r JOIN StringIds AS s ON s.id = r.nameId GROUP BY r.nameId"):
            api = _API_VERSION.sub("", str(name))
            if api not in MEMORY_APIS:
                continue
            calls[api] = calls.get(api, 0) + n
            if n_failed:
                failed[api] = failed.get(api, 0) + n_failed
                first_failure = first if first_failure is None else min(first_failure, first)
        first_us = None if first_failure is None else (int(first_failure) + self.offset_ns) // _EPOCH_NS_PER_US
        return calls, failed, first_us

    def _no_memory_table_warning(self) -> str:
        seen = ", ".join(f"{name} ×{n}" for name, n in sorted(self.api_calls.items()))
        api = (f"the CUDA API trace shows {seen} but not their sizes" if seen
               else "the CUDA API trace has no memory calls either")
        return ("no device memory table (CUDA_GPU_MEMORY_USAGE_EVENTS): the run was recorded without "
                f"--cuda-memory-usage=true, so only NVTX phases and GPU activity were read ({api}). {RECORD_MEMORY_HINT}")

    def _memory_failure_warning(self) -> None:
        if self.api_failures:
            calls = ", ".join(f"{name} ×{n}" for name, n in sorted(self.api_failures.items()))
            self.warnings.append(f"memory API calls failed ({calls}; the first at t={self.first_api_failure_us} µs): "
                                 "the device ran out of memory, or the allocator hit its limit and retried after "
                                 "freeing its cache")

    # ---- NVTX --------------------------------------------------------------------------------------
    def _annotations(self) -> pd.DataFrame:
        table = "NVTX_EVENTS"
        if not self.x.has(table, "start"):
            return empty_table("annotations")
        rows = self.x.frame(
            f"SELECT {self.x.select(table, 'n', ('start', 'end', 'eventType', 'text', 'globalTid', 'domainId'))}, "
            f"{'s.value' if self.x.has(table, 'textId') else 'NULL'} AS registered FROM {table} AS n "
            + ("LEFT JOIN StringIds AS s ON s.id = n.textId " if self.x.has(table, "textId") else "")
            + "ORDER BY n.start, n.rowid", ints=("start", "end", "eventType", "globalTid", "domainId"))
        rows["pid"] = rows["globalTid"] // _TID_SPAN % _TID_SPAN
        rows["message"] = rows["text"].fillna(rows["registered"])
        types = self.x.enum("ENUM_NSYS_EVENT_TYPE")
        if types:
            kind = rows["eventType"].map(types)
            domains = rows[kind == _DOMAIN_CREATE]
            rows = rows[kind.isin(_RANGE_TYPES | _MARK_TYPES).fillna(False).astype(bool)].copy()
            rows["end"] = rows["end"].fillna(rows["start"])  # a mark is an instant
        else:
            domains = rows.iloc[:0]
            if rows["end"].isna().any():
                self.warnings.append("the export predates ENUM_NSYS_EVENT_TYPE, so NVTX marks and domain names were not "
                                     "read (only ranges); export the report again with a current nsys for them")
            rows = rows[rows["end"].notna()].copy()
        domain_names = {(int(d.pid), int(d.domainId)): str(d.message) for d in domains.itertuples()
                        if not pd.isna(d.domainId) and not pd.isna(d.message) and not pd.isna(d.pid)}
        return self._annotation_table(rows, domain_names)

    def _annotation_table(self, rows: pd.DataFrame, domain_names: dict[tuple[int, int], str]) -> pd.DataFrame:
        device_by_pid = self._device_by_pid()
        default_device = min(self.devices, default=min(device_by_pid.values(), default=0))
        names, devices = [], []
        for pid, domain, message in zip(rows["pid"], rows["domainId"], rows["message"], strict=True):
            pid = None if pd.isna(pid) else int(pid)
            name = "(unnamed NVTX range)" if pd.isna(message) else annotation_name(str(message))
            domain_name = None if pid is None or pd.isna(domain) else domain_names.get((pid, int(domain)))
            names.append(f"{domain_name}:{name}" if domain_name else name)
            devices.append(device_by_pid.get(pid, default_device) if pid is not None else default_device)
        return make_table("annotations", {
            "device": devices, "name": names, "start_us": self._us(rows["start"]), "end_us": self._us(rows["end"]),
            "thread": pd.array(rows["globalTid"] % _TID_SPAN, dtype="Int64"),
        })

    # ---- GPU activity ------------------------------------------------------------------------------
    def _gpu_activity(self) -> pd.DataFrame:
        parts = []
        kernel, memcpy, memset = "CUPTI_ACTIVITY_KIND_KERNEL", "CUPTI_ACTIVITY_KIND_MEMCPY", "CUPTI_ACTIVITY_KIND_MEMSET"
        common = ("start", "end", "deviceId", "streamId")
        if self.x.has(kernel, *common):
            name = next((c for c in ("shortName", "demangledName") if c in self.x.columns(kernel)), None)
            parts.append(f"SELECT 'kernel' AS kind, {self.x.select(kernel, 'k', common)}, s.value AS name, NULL AS bytes "
                         f"FROM {kernel} AS k LEFT JOIN StringIds AS s ON s.id = "
                         + (f'k."{name}"' if name else "NULL"))
        if self.x.has(memcpy, *common, "bytes"):
            label = ("(SELECT e.label FROM ENUM_CUDA_MEMCPY_OPER AS e WHERE e.id = c.copyKind)"
                     if self.x.has("ENUM_CUDA_MEMCPY_OPER", "id", "label") and self.x.has(memcpy, "copyKind") else "NULL")
            parts.append(f"SELECT 'memcpy' AS kind, {self.x.select(memcpy, 'c', common)}, COALESCE({label}, 'memcpy') "
                         f"AS name, c.bytes AS bytes FROM {memcpy} AS c")
        if self.x.has(memset, *common, "bytes"):
            parts.append(f"SELECT 'memset' AS kind, {self.x.select(memset, 'm', common)}, 'memset' AS name, "
                         f"m.bytes AS bytes FROM {memset} AS m")
        if not parts:
            return pd.DataFrame({c: pd.Series(dtype=t) for c, t in GPU_ACTIVITY_COLUMNS.items()})
        rows = self.x.frame(" UNION ALL ".join(parts) + " ORDER BY start",
                            ints=("start", "end", "deviceId", "streamId", "bytes"))
        return pd.DataFrame({
            "kind": rows["kind"].astype(str), "device": rows["deviceId"].astype("int64"),
            "stream": pd.array(rows["streamId"], dtype="Int64"), "start_us": self._us(rows["start"]),
            "end_us": self._us(rows["end"]), "name": rows["name"].fillna("").astype(str),
            "bytes": pd.array(rows["bytes"], dtype="Int64"),
        })

    # ---- the program's own output ------------------------------------------------------------------
    def _crash_warning(self) -> None:
        """A run that died on an exception says so in its captured stderr; surface the exception line."""
        if not self.x.has("ProcessStreams", "filenameId", "contentId"):
            return
        streams = self.x.db.execute("SELECT f.value, c.value FROM ProcessStreams AS p JOIN StringIds AS f ON f.id = "
                                    "p.filenameId JOIN StringIds AS c ON c.id = p.contentId")
        for filename, content in streams:
            if "stderr" in str(filename) and "Traceback (most recent call last)" in str(content):
                last = next((line for line in reversed(str(content).splitlines()) if line.strip()), "")
                self.warnings.append(f"the profiled program ended with an exception ({last.strip()[:300]}); "
                                     "the recording stops there")

    # ---- assembly ----------------------------------------------------------------------------------
    def build(self) -> MemoryTrace:
        segments, events = self._memory()
        self._memory_failure_warning()
        annotations = self._annotations()
        kernels = self._gpu_activity()
        self._crash_warning()
        if len(events):
            self.warnings.append("Nsight records cudaMalloc/cudaFree calls, i.e. PyTorch's reserved segments (and "
                                 "memory of NCCL and other libraries), not tensors: reserved bytes are the device "
                                 "usage Nsight saw and the allocations table is empty. For tensor-level detail record "
                                 "a snapshot of the same run and combine both (analyze SNAPSHOT.pickle RUN.sqlite)")
        devices = dict(self.devices)
        for device in {*events["device"], *annotations["device"], *kernels["device"]}:
            devices.setdefault(int(device), DeviceInfo(int(device)))
        for device, n in events["device"].value_counts().items():
            devices[int(device)].trace_entries = int(n)
        check_devices(devices, self.x.path)
        return MemoryTrace(
            source_path=self.x.path, source_kind="nsys", allocations=empty_table("allocations"),
            segments=segments, blocks=empty_table("blocks"), events=events, stacks=empty_table("stacks"),
            annotations=annotations, ooms=empty_table("ooms"), devices=dict(sorted(devices.items())),
            has_history=bool(len(events)), warnings=self.warnings, kernels=kernels,
        )


def _segments_and_events(rows: pd.DataFrame, t_us: pd.array, is_alloc: np.ndarray) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Pair each free with the alloc of the same process and address; a free with no alloc was made before capture."""
    ev: dict[str, list[Any]] = {k: [] for k in ("device", "seq", "t_us", "action", "addr", "bytes")}
    seg: dict[str, list[Any]] = {k: [] for k in ("device", "addr", "bytes", "t_alloc_us", "t_free_us", "seq_alloc",
                                                "seq_free", "alive_at_end")}
    open_rows: dict[tuple[int, int, int], int] = {}
    next_seq: dict[int, int] = {}
    for device, pid, addr, size, t, alloc in zip(rows["deviceId"], rows["globalPid"].fillna(0), rows["address"],
                                                 rows["bytes"], t_us, is_alloc, strict=True):
        device, key = int(device), (int(device), int(pid), int(addr))
        seq = next_seq.get(device, 0)
        next_seq[device] = seq + 1
        t = None if pd.isna(t) else int(t)
        if alloc:
            open_rows[key] = len(seg["addr"])
            _append(seg, device=device, addr=int(addr), bytes=int(size), t_alloc_us=t, t_free_us=None, seq_alloc=seq,
                    seq_free=None, alive_at_end=True)
        elif (row := open_rows.pop(key, None)) is None:  # allocated before the capture started
            _append(seg, device=device, addr=int(addr), bytes=int(size), t_alloc_us=None, t_free_us=t, seq_alloc=None,
                    seq_free=seq, alive_at_end=False)
        else:
            seg["t_free_us"][row], seg["seq_free"][row], seg["alive_at_end"][row] = t, seq, False
            size = seg["bytes"][row]  # the reserved timeline must give back exactly what was taken
        _append(ev, device=device, seq=seq, t_us=t, action="segment_alloc" if alloc else "segment_free", addr=int(addr),
                bytes=int(size))
    n_seg, n_ev = len(seg["addr"]), len(ev["seq"])
    segments = make_table("segments", {**seg, "pool": ["unknown"] * n_seg, "stream": [0] * n_seg,
                                       "expandable": [False] * n_seg})
    events = make_table("events", {**ev, "stream": [0] * n_ev, "stack_id": [None] * n_ev})
    return segments, events.sort_values(["device", "seq"], kind="stable", ignore_index=True)


def _append(columns: dict[str, list], **values: Any) -> None:
    for name, value in values.items():
        columns[name].append(value)
