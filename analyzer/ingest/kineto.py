"""Read PyTorch Profiler (Kineto) Chrome traces (`.json`, `.json.gz`, and directories or `.tar.gz` of them).

Streaming: the file is parsed once with ijson's C backend, one `traceEvents` item at a time; only the events
below are kept, in compact arrays, so memory stays a small multiple of what is kept, never of the file. The
few top-level members (deviceProperties, distributedInfo, baseTimeNanoseconds) sit before or after the huge
`traceEvents` array; they are read from the first and last 8 MiB the parser passed through (see
`_Recorder`), and only if they do not fit there from a second, token-level pass.

What is kept:
- `[memory]` instant events -> `events`, `allocations`, synthetic `segments` (below);
- `[OutOfMemory]` instant events -> `ooms` and an `oom` event;
- `user_annotation` spans (ProfilerStep#N, Optimizer.step#..., Optimizer.zero_grad#..., record_function
  ranges, nccl:*) -> `annotations`, on the device the process used most;
- those, plus `python_function` spans (Python calls and `nn.Module: Class_k`), the `cpu_op` spans named
  `autograd::engine::evaluate_function: ...` (backward) and, in 2021 traces, the `Operator` spans that are not
  `aten::`-style ops (record_function ranges and autograd nodes) -> `trace.spans` (SPAN_COLUMNS);
- the thread of every memory event -> `trace.event_threads`, so that later stages can attribute allocations
  by time containment on their thread (memory events carry no op id);
- kernels only to learn which GPU the process drove; deviceProperties -> DeviceInfo name and capacity;
  distributedInfo -> `trace.rank` / `trace.world_size`;
- whether autograd recorded the ops -> `trace.grad_mode` (vocabulary.GradMode): the trace metadata's
  `grad_mode` where a harness writes it (`metadata.profiler.grad_mode`, as TraceLens' moca does); else
  `enabled` when any op carries autograd's Sequence number (every op dispatched with autograd on gets one,
  whether or not its inputs require grad), `off` when none of at least GRAD_MODE_MIN_OPS ops does (no_grad
  and inference_mode both leave them out), unknown (None) with fewer ops.

Formats in the wild:
- 2021 (torch 1.8-1.9): `[memory]` args hold only Device Type, Device Id and Bytes. Without addresses a free
  is paired with the most recent unmatched allocation of equal size on the same device: every size total is
  then exact at every event (which of two equal-sized blocks died first cannot be known and does not change
  any total). The allocated total starts at the sum of the frees that match nothing (blocks allocated before
  the trace), since no Total Allocated says otherwise. Record-function ranges there are `Operator` spans with
  `#` in their name.
- 2022-23: Addr, Total Allocated and Total Reserved; absolute integer microseconds.
- current: the same args, float microseconds relative to `baseTimeNanoseconds`.
All times become epoch microseconds, floored (containment on a thread survives flooring both ends).

Devices: the `device` column is the GPU index (Device Id) for every device type other than the host ones, so
CUDA (1), HIP (6, AMD ROCm traces), XPU, MPS and PrivateUse1 memory all stay on their GPU. Host memory (Device
Type 0 CPU, 2 MKLDNN, 5 IDEEP) is kept on device -1 (HOST): CPU-only runs then still have a history, and a
GPU report can show host memory beside the GPU without mixing the two.

Sizes: Kineto's Bytes is the block size (the caching allocator reports `block->size`), so requested_bytes =
allocated_bytes = |Bytes| (Kineto records no requested size).

Allocated bytes: with Total Allocated, the bytes already allocated when the window opened are known
(Total Allocated - Bytes of the first event). Frees that match no allocation become `before_trace` rows; what
they do not explain (memory alive through the whole window: weights, optimizer state) becomes one `end_state`
row of that many bytes at address 0, so the replayed allocated bytes equal the trace's own Total Allocated at
every event. Any event where they still differ (dropped events) is counted in a warning.

Reserved bytes: Kineto records no segment events, only Total Reserved after each event. Each change becomes
one `segment_alloc` or `segment_free` event (placed just before the memory event that reported it, as the
cudaMalloc or release happened inside that call) and the `segments` rows are synthetic ranges (pool
"unknown", address 0): a growth opens one, a shrink closes the newest ones first, splitting the last; the
reserved bytes before the first event are one segment alive from before the trace. The reserved timeline
then equals Total Reserved. Where no reserved figure exists (2021 traces, host memory whose Total Reserved is
always 0), reserved bytes are estimated as the running peak of allocated bytes: a lower bound, true for a
caching allocator that never released memory, flagged in the warnings.

Stacks: with `with_stack=True` the `python_function` spans form a call tree per thread (Python id / parent
id); the stack of a memory event is the innermost such span containing it on its thread and its ancestors
(innermost first, `nn.Module` markers left out). Memory events on autograd's backward thread have none.

A `.tar.gz` of traces becomes a MultiRankTrace (a directory of ranks: analyzer.ingest.ranks): one MemoryTrace per file, ordered
by the rank in distributedInfo, because every rank numbers its own GPUs from 0.
"""
from __future__ import annotations

import io
import json
import re
import tarfile
import zlib
from array import array
from collections import Counter, deque
from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path
from typing import IO, Any

import ijson
import numpy as np
import pandas as pd

from analyzer.core.allocator_rules import blas_workspace_bytes
from analyzer.core.intervals import innermost_open
from analyzer.core.stacks import stack_op, top_user_frame
from analyzer.core.trace import MISSING, DeviceInfo, MemoryTrace, MultiRankTrace, empty_table, make_table
from analyzer.core.vocabulary import GradMode
from analyzer.errors import CorruptInput, ResourceLimit, UnsupportedFormat
from analyzer.ingest import sniff
from analyzer.ingest.columns import MAX_TOTAL_BYTES
from analyzer.ingest.history import ByAddress, BySize, HistoryBuilder
from analyzer.ingest.json_depth import DepthLimitedStream
from analyzer.ingest.json_stream import first_byte, ijson_backend, reading
from analyzer.ingest.limits import check_devices, named_skips

HOST = -1
RECORD_HINT = ("Record it again with torch.profiler.profile(profile_memory=True, record_shapes=True, "
               "with_stack=True).")
_HINT = "Export the trace again with prof.export_chrome_trace() or the tensorboard_trace_handler."

#: one row per kept host span (`MemoryTrace.spans`); times are epoch µs like every other table
SPAN_COLUMNS: dict[str, str] = {
    "name": "category",
    "cat": "category",           # user_annotation | python_function | cpu_op | Operator (2021 traces)
    "start_us": "int64",
    "end_us": "int64",
    "thread": "int64",           # the tid of the span (a system thread id); -1 where the trace names it otherwise
    "python_id": "Int64",        # python_function only: its node in the call tree ...
    "parent_id": "Int64",        # ... and its caller's node
    "external_id": "Int64",      # links cpu_op / user_annotation to the GPU work they launched
    "sequence": "Int64",         # cpu_op: autograd's Sequence number (a backward node and the forward op that made it)
    "shapes": "category",        # cpu_op with record_shapes: its tensor inputs, `float[8, 64], float[64]`; "" if none
}

_MEMORY, _OOM = "[memory]", "[OutOfMemory]"
_HOST_TYPES = frozenset({0, 2, 5})          # c10::DeviceType CPU, MKLDNN, IDEEP
_DEVICE_APIS = {6: "ROCm/HIP", 12: "XPU", 13: "MPS"}  # GPUs that are not CUDA, named as the trace's type says
_USER, _PYTHON, _CPU_OP, _OPERATOR = range(4)
_SPAN_CATS = {"user_annotation": _USER, "python_function": _PYTHON, "cpu_op": _CPU_OP, "Operator": _OPERATOR}
_CAT_NAMES = list(_SPAN_CATS)
_BACKWARD = "autograd::engine::evaluate_function"
_KERNEL_CATS = frozenset({"kernel", "Kernel"})
#: a kernel cuBLAS launched (its GEMMs, CUTLASS or not, and Hopper's nvjet ones): the handle's workspace exists
_BLAS_KERNEL = re.compile(r"gemm|cublas|nvjet", re.IGNORECASE)
_FRAME = re.compile(r"^(.*)\((\d{1,9})\): (.*)$")  # a longer line number is no frame of a real file
_MODULE_MARK = "nn.Module: "
_HEAD_BYTES = 8 << 20
GRAD_MODE_MIN_OPS = 100  # ops without a single sequence number that show autograd was off (fewer say nothing)
_MAX_TS_US = 2.0**53                       # ~285 years: times beyond it are corrupt (and would overflow int64)
_TAIL_BYTES = 8 << 20
_SHAPES_CHARS = 160
_MAX_FRAMES = 1000       # frames kept of one stack (innermost first): a deeper call chain is a hostile input
#: ops that only allocate the output of the op around them: the op named for an allocation is the one outside
_ALLOCATING_OPS = frozenset({"aten::empty", "aten::empty_strided", "aten::empty_like", "aten::resize_",
                             "aten::new_empty", "aten::new_empty_strided"})


# ---- entry points -------------------------------------------------------------------------------------
def read_kineto(path: Path) -> MemoryTrace:
    """Load one Chrome trace (`.json` or `.json.gz`)."""
    with sniff.open_input(path) as stream:
        return parse_chrome_trace(stream, str(path), partial(sniff.open_input, path))


def read_trace_archive(path: Path) -> MultiRankTrace:
    """Load every Kineto trace inside a `.tar.gz` (one per rank), without unpacking it to disk."""
    traces, warnings, unpacked = [], [], 0
    try:
        with tarfile.open(path, "r:gz", tarinfo=sniff.BoundedTarInfo) as archive:
            for member in archive:
                if not member.isfile():
                    continue
                unpacked = _check_archive_size(path, unpacked + member.size)
                name = f"{path}!{member.name}"
                with _open_member(archive, member, name) as stream:
                    if first_byte(stream) != b"{":
                        warnings.append(f"skipped {member.name}: not a profiler trace")
                        continue
                    traces.append(parse_chrome_trace(stream, name, partial(_open_member, archive, member, name)))
    except (tarfile.TarError, EOFError, zlib.error, OSError) as error:
        raise CorruptInput(path, f"the archive is damaged ({error})", "Create it again with tar -czf.") from None
    return _rank_set(path, traces, named_skips(warnings))


def _rank_set(path: Path, traces: list[MemoryTrace], warnings: list[str]) -> MultiRankTrace:
    if not traces:
        raise UnsupportedFormat(path, "holds no PyTorch profiler trace", "Point at the folder the trace handler wrote.")
    traces.sort(key=lambda t: (t.rank is None, t.rank or 0, t.source_path))
    ranks = [t.rank for t in traces if t.rank is not None]
    duplicates = sorted(r for r, n in Counter(ranks).items() if n > 1)
    if duplicates:
        warnings.append(f"ranks {duplicates} appear in more than one trace (several windows of the same run?)")
    return MultiRankTrace(source_path=str(path), traces=traces, warnings=warnings)


def _check_archive_size(path: Path, total: int) -> int:
    """The decompression limits apply to the archive as a whole, its members' declared sizes together: at most
    ANALYZER_MAX_DECOMPRESSED_BYTES, and at most ANALYZER_MAX_COMPRESSION_RATIO times the archive's own size once
    past RATIO_FLOOR_BYTES (a few MB of tar.gz that unpack to gigabytes is a bomb, as a plain .json.gz would
    be); returns `total` when under both."""
    limit = sniff.max_decompressed_bytes()
    if total > limit:
        raise ResourceLimit(path, f"the archive unpacks to more than {limit} bytes",
                            "Raise ANALYZER_MAX_DECOMPRESSED_BYTES if the file is genuine.")
    ratio = sniff.max_compression_ratio()
    if total > sniff.RATIO_FLOOR_BYTES and total > ratio * max(path.stat().st_size, 1):
        raise ResourceLimit(path, f"the archive unpacks to more than {ratio} times its own size",
                            "Raise ANALYZER_MAX_COMPRESSION_RATIO if the file is genuine.")
    return total


def _open_member(archive: tarfile.TarFile, member: tarfile.TarInfo, name: str) -> IO[bytes]:
    """A buffered stream of one archive member, gunzipped (with the package's limits) when it is gzip."""
    stream = archive.extractfile(member)
    # regular files always have content, as a tarfile.ExFileObject (a BufferedReader; typeshed says IO[bytes])
    assert isinstance(stream, io.BufferedReader)
    if stream.peek(2)[:2] == b"\x1f\x8b":
        return sniff.gunzip(stream, name)
    return stream


# ---- one trace ----------------------------------------------------------------------------------------
def parse_chrome_trace(stream: IO[bytes], name: str, reopen: Callable[[], IO[bytes]]) -> MemoryTrace:
    """Stream one Chrome trace into a MemoryTrace; `reopen` gives the bytes again for the rare second look at
    top-level members that do not fit in the kept edges."""
    if first_byte(stream) not in (b"{", b""):
        raise CorruptInput(name, "the top level is not a JSON object, so this is not a Chrome trace", _HINT)
    backend, warnings = ijson_backend()
    recorder = _Recorder(DepthLimitedStream(stream, name))
    kept = _Kept()
    with reading(name, _HINT):
        floor = kept.collect(backend.items(recorder, "traceEvents.item", use_float=True), recorder)
        try:
            meta = _metadata_from_edges(recorder, floor)
            if meta is None:
                with reopen() as again:
                    meta = _metadata_by_tokens(backend, again)
        except NoTraceEvents:
            raise CorruptInput(name, "looks like JSON without traceEvents, not a profiler trace",
                               sniff.ACCEPTED) from None
        return _Assembler(name, kept, meta, warnings).build()


class NoTraceEvents(ValueError):
    """A JSON object with no `traceEvents` member: some other JSON, not a Chrome trace."""


class _Recorder:
    """File wrapper that keeps the first and last bytes it hands to the parser (_HEAD_BYTES, _TAIL_BYTES).

    The small top-level members of a trace sit before or after `traceEvents` (Kineto writes deviceProperties
    and distributedInfo first and baseTimeNanoseconds last; re-serialised files move them), so they can be
    read from these edges instead of parsing the whole file a second time.
    """

    def __init__(self, stream: DepthLimitedStream) -> None:
        self._stream = stream
        self.head = bytearray()
        self._tail: deque[bytes] = deque()
        self._tail_bytes = 0
        self.offset = 0          # bytes handed out so far
        self.chunk_start = 0     # offset of the latest chunk: events the parser yields now ended after it

    def read(self, size: int = -1) -> bytes:
        chunk = self._stream.read(size)
        self.chunk_start = self.offset
        self.offset += len(chunk)
        if len(self.head) < _HEAD_BYTES:
            self.head += chunk[: _HEAD_BYTES - len(self.head)]
        self._tail.append(chunk)
        self._tail_bytes += len(chunk)
        while self._tail_bytes - len(self._tail[0]) >= _TAIL_BYTES:
            self._tail_bytes -= len(self._tail.popleft())
        return chunk

    def tail(self) -> tuple[int, bytes]:
        """(offset of the first kept byte, the last bytes of the stream)."""
        return self.offset - self._tail_bytes, b"".join(self._tail)


class _Kept:
    """The events worth keeping, in compact columns, filled in one pass over the stream."""

    def __init__(self) -> None:
        # memory and OOM events
        self.m_ts, self.m_tid, self.m_device = array("d"), array("q"), array("q")
        self.m_addr, self.m_bytes, self.m_allocated, self.m_reserved = array("q"), array("q"), array("q"), array("q")
        self.m_oom = array("b")
        # spans
        self.s_cat, self.s_name, self.s_ts, self.s_dur = array("b"), array("q"), array("d"), array("d")
        self.s_tid, self.s_python, self.s_parent, self.s_external = array("q"), array("q"), array("q"), array("q")
        self.s_sequence, self.s_shapes = array("q"), array("q")
        self.names: dict[str, int] = {}
        self.shapes: dict[str, int] = {"": 0}
        self.kernel_devices: Counter = Counter()
        self.blas_devices: set[Any] = set()   # the devices a cuBLAS kernel ran on
        self.device_apis: dict[Any, str] = {}

    def collect(self, events: Iterable[dict], recorder: _Recorder) -> int:
        """Keep what matters from every event; returns an offset the traceEvents array ends after."""
        memory, span, kernels = self._memory, self._span, self.kernel_devices
        floor = 0
        for event in events:
            floor = recorder.chunk_start
            # any JSON value, None when absent: what a span cannot use raises inside reading() (a CorruptInput)
            name: Any = event.get("name")
            if name == _MEMORY or name == _OOM:
                memory(event, name == _OOM)
                continue
            cat: Any = event.get("cat")  # likewise
            code = _SPAN_CATS.get(cat)
            if code is not None:
                span(event, code, name)
            elif cat in _KERNEL_CATS:
                device = (event.get("args") or {}).get("device")
                kernels[device] += 1
                if device not in self.blas_devices and isinstance(name, str) and _BLAS_KERNEL.search(name):
                    self.blas_devices.add(device)   # once a device has one, its other kernels are not searched
        return floor

    def _memory(self, event: dict, oom: bool) -> None:
        args = event["args"]
        device_type = args["Device Type"]
        self.m_ts.append(event["ts"])
        self.m_tid.append(_thread(event.get("tid")))
        device = HOST if device_type in _HOST_TYPES else args["Device Id"]
        self.m_device.append(device)
        if device_type in _DEVICE_APIS:
            self.device_apis[device] = _DEVICE_APIS[device_type]
        self.m_addr.append(args.get("Addr", MISSING))
        self.m_bytes.append(args["Bytes"])
        self.m_allocated.append(args.get("Total Allocated", MISSING))
        self.m_reserved.append(args.get("Total Reserved", MISSING))
        self.m_oom.append(oom)

    def _span(self, event: dict, code: int, name: str) -> None:
        args = event.get("args") or {}
        self.s_cat.append(code)
        self.s_name.append(self.names.setdefault(name, len(self.names)))
        self.s_ts.append(event["ts"])
        self.s_dur.append(event.get("dur", 0))
        self.s_tid.append(_thread(event.get("tid")))
        self.s_python.append(_optional_int(args.get("Python id")))
        self.s_parent.append(_optional_int(args.get("Python parent id")))
        self.s_external.append(_optional_int(args.get("External id")))
        op = code == _CPU_OP or code == _OPERATOR
        self.s_sequence.append(_optional_int(args.get("Sequence number")) if op else MISSING)
        shapes = _shapes(args.get("Input Dims"), args.get("Input type")) if op else ""
        self.s_shapes.append(self.shapes.setdefault(shapes, len(self.shapes)))


def _shapes(dims: Any, types: Any) -> str:
    """`float[8, 64], float[64]`: the tensor inputs of an op recorded with record_shapes (scalars and lists left
    out), at most _SHAPES_CHARS characters."""
    if not isinstance(dims, list) or not isinstance(types, list):
        return ""
    tensors = [f"{t}[{', '.join(str(n) for n in d)}]" for d, t in zip(dims, types, strict=False)
               if isinstance(d, list) and d and isinstance(t, str) and t]
    text = ", ".join(tensors)
    return text if len(text) <= _SHAPES_CHARS else text[: _SHAPES_CHARS - 1] + "…"


def _thread(tid: Any) -> int:
    """Thread ids are ints, or their decimal strings in 2021 traces; anything else (labels) is -1."""
    if type(tid) is int:
        return tid
    return int(tid) if isinstance(tid, str) and tid.isdigit() else -1


def _optional_int(value: Any) -> int:
    return MISSING if value is None else value


def _array(values: array, dtype: str) -> np.ndarray:
    return np.frombuffer(values, dtype=dtype) if len(values) else np.zeros(0, dtype=dtype)


# ---- top-level members ----------------------------------------------------------------------------------
_ARRAY_END = re.compile(r"[}\[]\s*\]")
_SPACE = re.compile(r"\s*")
_DECODER = json.JSONDecoder()


def _skip_space(text: str, pos: int = 0) -> int:
    """The position after the whitespace at `pos`."""
    match = _SPACE.match(text, pos)
    assert match is not None  # `\s*` matches the empty string at any position
    return match.end()


def _metadata_from_edges(recorder: _Recorder, floor: int) -> dict[str, Any] | None:
    """Top-level members other than traceEvents, from the kept head and tail; None when they do not hold them."""
    head = recorder.head.decode("utf-8", "surrogateescape")
    try:
        before, key_at = _members_before_events(head)
    except (ValueError, IndexError):
        return None  # a member before traceEvents is longer than the head
    if key_at is None:
        raise NoTraceEvents("the top-level object has no traceEvents")
    tail_start, tail = recorder.tail()
    events_at = len(head[:key_at].encode("utf-8", "surrogateescape"))
    start = max(floor, events_at) - tail_start
    if start < 0:
        return None  # members after traceEvents are longer than the tail
    after = _members_after_events(tail[start:].decode("utf-8", "surrogateescape"))
    return None if after is None else {**before, **after}


def _member(text: str, pos: int) -> tuple[str, Any, int]:
    """Parse `"key": value` at `pos` (after optional space)."""
    key, pos = _DECODER.raw_decode(text, _skip_space(text, pos))
    pos = _skip_space(text, pos)
    if not isinstance(key, str) or text[pos] != ":":
        raise ValueError("not an object member")
    value, pos = _DECODER.raw_decode(text, _skip_space(text, pos + 1))
    return key, value, pos


def _members_before_events(head: str) -> tuple[dict[str, Any], int | None]:
    """Members from the opening brace up to the traceEvents key (its position; None when the object ends first)."""
    members: dict[str, Any] = {}
    pos = _skip_space(head) + 1
    while True:
        pos = _skip_space(head, pos)
        if head[pos] == "}":
            return members, None
        if members or head[pos] == ",":
            if head[pos] != ",":
                raise ValueError("expected a comma")
            pos = _skip_space(head, pos + 1)
        if head.startswith('"traceEvents"', pos):
            return members, pos
        key, value, pos = _member(head, pos)
        members[key] = value


def _members_after_events(tail: str) -> dict[str, Any] | None:
    """Members after the traceEvents array. Its end is the first `}]` or `[]` from which the rest of the text
    parses as members and the final brace: inside an event, parsing from a bracket fails before the end."""
    for match in _ARRAY_END.finditer(tail):
        members: dict[str, Any] = {}
        pos = match.end()
        try:
            while True:
                pos = _skip_space(tail, pos)
                if tail[pos] == "}":
                    if tail[pos + 1:].strip():
                        break
                    return members
                if tail[pos] != ",":
                    break
                key, value, pos = _member(tail, pos + 1)
                if key == "traceEvents":
                    break
                members[key] = value
        except (ValueError, IndexError):
            continue
    return None


def _metadata_by_tokens(backend: Any, stream: IO[bytes]) -> dict[str, Any]:
    """Second pass, token by token, for traces whose top-level members do not fit in the kept edges."""
    members: dict[str, Any] = {}
    builder, key, has_events = None, None, False
    for prefix, event, value in backend.parse(stream, use_float=True):
        if prefix == "":
            if event == "map_key":
                key, has_events = value, has_events or value == "traceEvents"
                builder = None if value == "traceEvents" else ijson.ObjectBuilder()
            continue
        if builder is None:
            continue
        builder.event(event, value)
        if prefix == key and event not in ("start_map", "start_array", "map_key"):
            members[key] = builder.value
            builder = None
    if not has_events:
        raise NoTraceEvents("the top-level object has no traceEvents")
    return members


# ---- python call stacks and ops --------------------------------------------------------------------------
class _Stacks:
    """Interned stacks of memory events: the frames of the innermost python_function span open at the event on
    its thread (its callers through Python parent ids, innermost first, at most _MAX_FRAMES) and the op the
    trace says made it (the innermost cpu_op open then, passing over the ops that only allocate another op's
    output, `aten::empty`; with record_shapes its tensor inputs)."""

    def __init__(self, kept: _Kept, names: list[str]) -> None:
        self.frames: list[tuple] = []
        self.ops: list[str | None] = []
        self._ids: dict[tuple, int] = {}
        cats = _array(kept.s_cat, "b")
        self._start = _array(kept.s_ts, "d")
        self._end = self._start + _array(kept.s_dur, "d")
        self._tid = _array(kept.s_tid, "q")
        self._names = names
        self._name = _array(kept.s_name, "q")
        self._python = np.flatnonzero(cats == _PYTHON)
        ranges = [i for i, n in enumerate(names) if n.startswith(_BACKWARD) or "#" in n]  # not ops
        self._ops = np.flatnonzero(((cats == _CPU_OP) | (cats == _OPERATOR)) & ~np.isin(self._name, ranges))
        self._allocating = np.isin(self._name, [names.index(n) for n in _ALLOCATING_OPS if n in names])
        shapes = list(kept.shapes)
        self._shapes = _array(kept.s_shapes, "q")
        self._shape_text = shapes
        ids = _array(kept.s_python, "q")[self._python].tolist()
        by_id = {pid: i for i, pid in enumerate(ids) if pid != MISSING}
        # Python ids grow in call order, so a caller's id is smaller: requiring it keeps any input acyclic.
        self._parent = np.array([by_id.get(parent, -1) if parent < pid else -1
                                 for pid, parent in zip(ids, _array(kept.s_parent, "q")[self._python].tolist(), strict=True)],
                                dtype=np.int64)
        self._frame_of = [_frame(names[i]) for i in self._name[self._python].tolist()]
        self._chains: dict[int, tuple] = {}

    def of_events(self, ts: np.ndarray, tid: np.ndarray) -> list[int | None]:
        """The stack id of each event (None where neither a Python call nor an op contains it)."""
        ids: list[int | None] = [None] * len(ts)
        if not len(self._python) and not len(self._ops):
            return ids
        for thread in np.unique(tid).tolist():
            events = np.flatnonzero(tid == thread)
            calls = np.flatnonzero(self._tid[self._python] == thread)  # positions in self._python
            spans, ops = self._python[calls], self._ops[self._tid[self._ops] == thread]
            call = innermost_open(self._start[spans], self._end[spans], ts[events])
            op = innermost_open(self._start[ops], self._end[ops], ts[events], skip=self._allocating[ops])
            for event, c, o in zip(events.tolist(), call.tolist(), op.tolist(), strict=True):
                frames = self._chain(int(calls[c])) if c >= 0 else ()
                ids[event] = self._intern(frames, self._op_text(int(ops[o])) if o >= 0 else None)
        return ids

    def _chain(self, node: int) -> tuple:
        """Frames of python span `node` (a position in self._python) and its callers, innermost first."""
        chain = self._chains.get(node)
        if chain is None:
            frames: list[tuple[str, int, str] | None] = []
            at = node
            while at >= 0 and len(frames) < _MAX_FRAMES:
                frames.append(self._frame_of[at])
                at = int(self._parent[at])
            chain = self._chains[node] = tuple(f for f in frames if f is not None)
        return chain

    def _op_text(self, span: int) -> str:
        shapes = self._shape_text[int(self._shapes[span])]
        name = self._names[int(self._name[span])]
        return f"{name}({shapes})" if shapes else name

    def _intern(self, frames: tuple, op: str | None) -> int | None:
        if not frames and op is None:
            return None
        key = (frames, op)
        sid = self._ids.get(key)
        if sid is None:
            sid = self._ids[key] = len(self.frames)
            self.frames.append(frames)
            self.ops.append(op)
        return sid

    def table(self) -> pd.DataFrame:
        return make_table("stacks", {"stack_id": np.arange(len(self.frames), dtype=np.int64), "frames": self.frames,
                                     "top_user_frame": [top_user_frame(f) for f in self.frames],
                                     "op": [op or stack_op(f) for f, op in zip(self.frames, self.ops, strict=True)]})


def _frame(name: str) -> tuple[str, int, str] | None:
    """(file, line, function) of a python_function name `file(line): function`; built-ins get file
    `<built-in>`; `nn.Module: X_k` markers are not frames."""
    if name.startswith(_MODULE_MARK):
        return None
    match = _FRAME.match(name)
    return (match[1], int(match[2]), match[3]) if match else ("<built-in>", 0, name)


# ---- from kept events to a MemoryTrace --------------------------------------------------------------------
class _Assembler:
    """Turns the kept events and top-level members into the shared tables."""

    def __init__(self, name: str, kept: _Kept, meta: dict[str, Any], warnings: list[str]) -> None:
        self.name, self.kept, self.meta, self.warnings = name, kept, meta, warnings
        self.reserved_estimated: set[int] = set()   # devices whose events carry no Total Reserved
        self.before_unknown: set[int] = set()       # devices whose events carry no Total Allocated
        self.workspaces_before: dict[int, int] = {}  # device -> its cuBLAS workspace, set apart from what lived before
        self.names = list(kept.names)
        #: deviceProperties by device id
        self.properties = {p.get("id"): p for p in meta.get("deviceProperties") or [] if isinstance(p, dict)}
        base_ns = meta.get("baseTimeNanoseconds")
        self.base_ns = int(base_ns) if isinstance(base_ns, (int, float)) else None

    def epoch_us(self, ts: np.ndarray) -> np.ndarray:
        """Floored epoch microseconds: relative float µs plus baseTimeNanoseconds where the trace has it.
        A time that is not finite or beyond ±2**53 µs is refused rather than cast into a nonsense integer."""
        if len(ts) and not (np.abs(ts) < _MAX_TS_US).all():
            raise ValueError(f"event times outside ±{_MAX_TS_US:.0f} µs (not finite, or absurdly far)")
        if self.base_ns is None:
            return np.floor(ts).astype(np.int64)
        return np.floor(ts + (self.base_ns % 1000) / 1000).astype(np.int64) + self.base_ns // 1000

    def build(self) -> MemoryTrace:
        k = self.kept
        check_devices({*np.unique(_array(k.m_device, "q")).tolist(), *k.kernel_devices}, self.name)
        ts, tid = _array(k.m_ts, "d"), _array(k.m_tid, "q")
        stacks = _Stacks(k, self.names)
        builder = self._replay(ts, tid, stacks.of_events(ts, tid))
        tables = builder.tables()
        devices = self._devices(tables["events"], tables["truncated"])
        main = self._main_device(devices)
        has_history = bool(len(ts))
        if not has_history:
            self.warnings.append(f"this trace has no [memory] events, so it holds no memory history. {RECORD_HINT}")
        if HOST in devices and len(devices) > 1:
            self.warnings.append("host (CPU) memory events are kept on device -1, apart from the GPU")
        distributed = self.meta.get("distributedInfo") or {}
        spans = self._spans()
        return MemoryTrace(
            source_path=self.name, source_kind="kineto",
            allocations=tables["allocations"], segments=tables["segments"], blocks=empty_table("blocks"),
            events=tables["events"], stacks=stacks.table(), annotations=_annotations(spans, main), ooms=tables["ooms"],
            devices=devices, torch_era=self._era(), has_history=has_history,
            warnings=self.warnings + builder.warnings, spans=spans, event_threads=tables["event_threads"],
            rank=_int_or_none(distributed.get("rank")), world_size=_int_or_none(distributed.get("world_size")),
            source_time_base_us=0 if self.base_ns is None else self.base_ns // 1000, grad_mode=self._grad_mode(),
        )

    def _grad_mode(self) -> str | None:
        """What the trace says of autograd: its metadata's grad_mode, else the ops' sequence numbers."""
        metadata = self.meta.get("metadata")
        profiler = metadata.get("profiler") if isinstance(metadata, dict) else None
        recorded = profiler.get("grad_mode") if isinstance(profiler, dict) else None
        if recorded in {m.value for m in GradMode}:
            return str(recorded)
        k = self.kept
        cats = _array(k.s_cat, "b")
        ops = (cats == _CPU_OP) | (cats == _OPERATOR)
        if (_array(k.s_sequence, "q")[ops] != MISSING).any():
            return GradMode.ENABLED.value
        return GradMode.OFF.value if int(ops.sum()) >= GRAD_MODE_MIN_OPS else None

    def _replay(self, ts: np.ndarray, tid: np.ndarray, stack_ids: list[int | None]) -> HistoryBuilder:
        """Every device's memory events in time order (file order breaks ties) through one HistoryBuilder."""
        k = self.kept
        device = _array(k.m_device, "q")
        order = np.argsort(ts, kind="stable")
        order = order[np.argsort(device[order], kind="stable")]
        builder = HistoryBuilder()
        t_us = self.epoch_us(ts)
        columns = [t_us, tid, _array(k.m_addr, "q"), _array(k.m_bytes, "q"), _array(k.m_allocated, "q"),
                   _array(k.m_reserved, "q"), _array(k.m_oom, "b")]
        for d in np.unique(device).tolist():
            rows = order[device[order] == d]
            self._replay_device(builder, d, [c[rows] for c in columns], [stack_ids[i] for i in rows.tolist()])
        return builder

    def _replay_device(self, builder: HistoryBuilder, device: int, columns: list[np.ndarray],
                       stacks: list[int | None]) -> None:
        t, tid, addr, nbytes, allocated, reserved, oom = columns
        _check_sizes(nbytes, allocated, reserved)
        memory = oom == 0
        by_address = bool(memory.any()) and bool((addr[memory] != MISSING).all())
        has_reserved = device != HOST and bool(memory.any()) and bool((reserved[memory] != MISSING).all())
        if not has_reserved:
            self.reserved_estimated.add(device)
        builder.start_device(device, ByAddress if by_address else BySize)
        for t_i, tid_i, addr_i, bytes_i, reserved_i, oom_i, stack in zip(
                t.tolist(), tid.tolist(), addr.tolist(), nbytes.tolist(), reserved.tolist(), oom.tolist(), stacks, strict=True):
            if has_reserved and reserved_i != MISSING:
                builder.reserve(t_i, reserved_i, tid_i)
            address = addr_i if by_address else 0
            if oom_i:
                builder.oom(t_i, bytes_i, stack, tid_i)
            elif bytes_i > 0:
                builder.alloc(t_i, bytes_i, address, stack, tid_i)
            elif bytes_i < 0:
                builder.free(t_i, -bytes_i, address, stack, tid_i)
        totals = allocated[memory]
        known = bool(len(totals)) and bool((totals != MISSING).all())
        workspace = self._workspace_before(device, nbytes[memory])
        start = builder.finish_device(int(totals[0] - nbytes[memory][0]) if known else None, workspace)
        if workspace and builder.set_apart:
            self.workspaces_before[device] = workspace
        if not known:
            self.before_unknown.add(device)
        self._check_totals(device, start, nbytes[memory], totals if known else None, by_address, has_reserved)

    def _workspace_before(self, device: int, nbytes: np.ndarray) -> int | None:
        """The cuBLAS workspace alive before the trace, inside its running total: cuBLAS ran on this CUDA device
        while no allocation of the workspace's size was made, so the handle's workspace (made at its thread's
        first matmul, kept for the process) predates the window. None where the trace does not show that, or the
        default size for the device is not known (its compute capability, or a GPU torch versions size apart)."""
        if device == HOST or device in self.kept.device_apis or device not in self.kept.blas_devices:
            return None
        capability = self._compute_capability(device)
        size = blas_workspace_bytes(capability) if capability else None
        return size if size and not (nbytes == size).any() else None

    def _compute_capability(self, device: int) -> tuple[int, int] | None:
        p = self.properties.get(device, {})
        major, minor = p.get("computeMajor"), p.get("computeMinor")
        return (major, minor) if isinstance(major, int) and isinstance(minor, int) else None

    def _check_totals(self, device: int, start: int, nbytes: np.ndarray, totals: np.ndarray | None,
                      by_address: bool, has_reserved: bool) -> None:
        """Warn where the replay cannot match the trace's own figures, and say what was reconstructed."""
        if totals is not None:
            differ = int(np.count_nonzero(start + np.cumsum(nbytes) != totals))
            if differ:
                self.warnings.append(f"device {device}: replayed allocated bytes differ from the trace's Total "
                                     f"Allocated at {differ} of {len(totals)} events (events were dropped?)")
        else:
            self.warnings.append(f"device {device}: [memory] events carry no Total Allocated (2021 format): totals "
                                 "are rebuilt by summing Bytes from the frees of earlier blocks")
        if not by_address and len(nbytes):
            self.warnings.append(f"device {device}: [memory] events carry no Addr: frees are paired with the latest "
                                 "open allocation of the same size")
        if not has_reserved and len(nbytes):
            self.warnings.append(f"device {device}: no reserved bytes recorded; reserved is estimated as the running "
                                 "peak of allocated bytes (a lower bound)")

    def _devices(self, events: pd.DataFrame, truncated: set[int]) -> dict[int, DeviceInfo]:
        """Devices with memory events, or else the GPUs kernels ran on (ROCm numbers kernel devices by agent,
        which differs from the HIP index of memory events, so kernels never add a device beside memory);
        names and capacities from deviceProperties."""
        properties = self.properties
        counts = events["device"].value_counts().to_dict()
        ids = set(counts)
        if not ids - {HOST}:
            ids |= {d for d in self.kept.kernel_devices if isinstance(d, int)}
        devices = {}
        for d in sorted(ids):
            p = properties.get(d, {}) if d != HOST else {"name": "CPU (host memory)"}
            memory = p.get("totalGlobalMem")
            devices[d] = DeviceInfo(d, trace_entries=int(counts.get(d, 0)), history_truncated=d in truncated,
                                    name=p.get("name"), capacity_bytes=int(memory) if isinstance(memory, int) else None,
                                    api=self.kept.device_apis.get(d), reserved_recorded=d not in self.reserved_estimated,
                                    before_recorded=d not in self.before_unknown,
                                    workspace_before_bytes=self.workspaces_before.get(d))
        return devices

    def _main_device(self, devices: dict[int, DeviceInfo]) -> int:
        """The GPU the process used most (memory events, then kernels); the host when it used none."""
        gpus = [d for d in devices if d != HOST]
        if not gpus:
            return HOST
        return max(gpus, key=lambda d: (devices[d].trace_entries, self.kept.kernel_devices.get(d, 0), -d))

    def _spans(self) -> pd.DataFrame:
        """The kept spans as SPAN_COLUMNS; names and categories as pandas categoricals (interned once)."""
        k = self.kept
        start = _array(k.s_ts, "d")
        python, parent, external, sequence = (_array(c, "q") for c in (k.s_python, k.s_parent, k.s_external,
                                                                        k.s_sequence))
        return pd.DataFrame({
            "name": pd.Categorical.from_codes(_array(k.s_name, "q"), categories=self.names) if self.names
            else pd.Categorical([]),
            "cat": pd.Categorical.from_codes(_array(k.s_cat, "b").astype(np.int64), categories=_CAT_NAMES),
            "start_us": self.epoch_us(start), "end_us": self.epoch_us(start + _array(k.s_dur, "d")),
            "thread": _array(k.s_tid, "q").copy(),
            "python_id": pd.arrays.IntegerArray(python.copy(), python == MISSING),
            "parent_id": pd.arrays.IntegerArray(parent.copy(), parent == MISSING),
            "external_id": pd.arrays.IntegerArray(external.copy(), external == MISSING),
            "sequence": pd.arrays.IntegerArray(sequence.copy(), sequence == MISSING),
            "shapes": pd.Categorical.from_codes(_array(k.s_shapes, "q"), categories=list(k.shapes)),
        }, columns=list(SPAN_COLUMNS))

    def _era(self) -> str:
        addr = _array(self.kept.m_addr, "q")
        if len(addr) and (addr == MISSING).all():
            return "kineto 2021 (torch 1.8-1.9): [memory] with Bytes only"
        if self.base_ns is not None:
            return "kineto (times relative to baseTimeNanoseconds)"
        return "kineto (absolute microseconds)"


def _annotations(spans: pd.DataFrame, device: int) -> pd.DataFrame:
    """user_annotation spans (and 2021 `Operator` ranges named with `#`) on the process's main device."""
    names = spans["name"].astype(str)
    keep = (spans["cat"] == "user_annotation") | ((spans["cat"] == "Operator") & names.str.contains("#", regex=False))
    chosen = spans[keep]
    return make_table("annotations", {"device": np.full(len(chosen), device, dtype=np.int64),
                                      "name": names[keep].tolist(), "start_us": chosen["start_us"],
                                      "end_us": chosen["end_us"], "thread": chosen["thread"]})


def _check_sizes(nbytes: np.ndarray, allocated: np.ndarray, reserved: np.ndarray) -> None:
    """No negative total, and no sum of sizes past MAX_TOTAL_BYTES (the timeline's int64 sums would wrap)."""
    totals = np.concatenate([allocated, reserved])
    if ((totals < 0) & (totals != MISSING)).any():
        raise ValueError("a Total Allocated or Total Reserved is negative")
    if np.abs(nbytes.astype(np.float64)).sum() > MAX_TOTAL_BYTES or totals.max(initial=0) > MAX_TOTAL_BYTES:
        raise ValueError(f"sizes add up to more than {MAX_TOTAL_BYTES} bytes")


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
