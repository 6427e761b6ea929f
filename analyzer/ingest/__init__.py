"""Readers: one module per input format, each turning a file into a MemoryTrace.

`load()` sniffs the format from the bytes and dispatches through `READERS`; a new format is one new module
and one new line in that table.
"""
from __future__ import annotations

import importlib
import shlex
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Union

from analyzer.core.gc_pause import gc_paused
from analyzer.errors import UnsupportedFormat
from analyzer.ingest import sniff as formats
from analyzer.ingest.confined import confined

if TYPE_CHECKING:  # the tables import pandas: sniffing a text log (analyzer.ingest.sniff) must not
    from analyzer.core.trace import MemoryTrace, MultiRankTrace

Loaded = Union["MemoryTrace", "MultiRankTrace"]  # one recording, or a set of ranks (a directory or .tar.gz of traces)

#: kind -> "module:function" of the reader (imported on use, so one format's dependencies never slow another)
READERS: dict[str, str] = {
    formats.SNAPSHOT: "analyzer.ingest.snapshot:read_snapshot",
    formats.KINETO: "analyzer.ingest.kineto:read_kineto",
    formats.TRACE_ARCHIVE: "analyzer.ingest.kineto:read_trace_archive",
    formats.TRACE_DIRECTORY: "analyzer.ingest.ranks:read_rank_directory",
    formats.MEMORY_TIMELINE: "analyzer.ingest.memory_timeline:read_memory_timeline",
    formats.MEMORY_TIMELINE_RAW: "analyzer.ingest.memory_timeline:read_memory_timeline",
    formats.NSYS_SQLITE: "analyzer.ingest.nsys:read_nsys",
}

_NOT_YET: dict[str, str] = {
    formats.LOG: "a text log as a MemoryTrace (it holds no allocation history; `analyze FILE` diagnoses it)",
}


def reader_for(kind: str, path: Path) -> Callable[[Path], Loaded]:
    if kind == formats.NSYS_REP:
        sqlite = path.with_suffix(".sqlite")
        raise UnsupportedFormat(path, "this is a binary Nsight Systems report (.nsys-rep), which only nsys can read",
                                f"Export it first: nsys export --type sqlite --output {shlex.quote(str(sqlite))} "
                                f"{shlex.quote(str(path))}, then analyze the .sqlite file.")
    target = READERS.get(kind)
    if target is None:
        raise UnsupportedFormat(path, f"reading {_NOT_YET.get(kind, kind)} is not supported by this version",
                                "Record a CUDA memory snapshot with torch.cuda.memory._dump_snapshot() instead.")
    module, function = target.split(":")
    return getattr(importlib.import_module(module), function)


def load_with_companion(path: str | Path, companion: str | Path | None) -> tuple[Loaded, MemoryTrace | None]:
    """The recording to analyse and, optionally, an Nsight export of the same run that shows the device's
    memory (in either order)."""
    from analyzer.core.trace import MemoryTrace

    first = load(path)
    if companion is None:
        return first, None
    second = load(companion)
    kinds = (first.source_kind if isinstance(first, MemoryTrace) else "ranks",
             second.source_kind if isinstance(second, MemoryTrace) else "ranks")
    if kinds.count("nsys") != 1:
        raise UnsupportedFormat(companion, f"two inputs are analysed together only as a recording plus an Nsight "
                                f"export of the same run (got {kinds[0]} and {kinds[1]})",
                                "Pass the snapshot first and the nsys .sqlite second, or analyse each file alone.")
    if kinds[0] == "nsys":
        assert isinstance(first, MemoryTrace)  # only a MemoryTrace has a kind, "ranks" stands for the others
        return second, first
    assert isinstance(second, MemoryTrace)  # the other one is the single nsys input
    return first, second


def load(path: str | Path) -> Loaded:
    """Read any supported input into a MemoryTrace (a MultiRankTrace for a set of ranks); raises an AnalyzerError
    subclass on bad input. The reader runs in a child process with CPU-time and memory limits (ingest.confined)."""
    p = formats.check_path(path)
    reader = reader_for(formats.sniff(p), p)
    with gc_paused(), formats.watched(p):
        return confined(partial(reader, p), p)
