"""A Chrome trace read again, event by event, for `--export-trace` to copy it whole beside the counters it adds.

The original is streamed (ijson), never held whole: a profiler trace can be larger than the analysis keeps. The
command opens it here, in ingest, so the reporter that writes the copy never reopens an input.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ijson

from analyzer.core.trace import MemoryTrace
from analyzer.errors import UnsupportedFormat
from analyzer.ingest.sniff import KINETO, open_input


@dataclass(frozen=True)
class ChromeTraceCopy:
    """The trace at `path`, to be streamed again (each call reopens it, so a second attempt at writing works)."""

    path: Path

    def events(self) -> Iterator[Any]:
        """Every item of traceEvents, in order."""
        with open_input(self.path) as stream:
            yield from ijson.items(stream, "traceEvents.item")

    def members(self) -> Iterator[tuple[str, Any]]:
        """Top-level members other than traceEvents (device properties, distributed info, time base ...)."""
        with open_input(self.path) as stream:
            builder, key, depth = None, None, 0
            for prefix, event, value in ijson.parse(stream):
                if prefix == "" and event == "map_key":
                    key, builder = value, None
                    continue
                if key is None or key == "traceEvents" or (prefix == "" and event in ("start_map", "end_map")):
                    continue
                if builder is None:
                    builder, depth = ijson.ObjectBuilder(), 0
                builder.event(event, value)
                depth += event in ("start_map", "start_array")
                depth -= event in ("end_map", "end_array")
                if depth == 0:
                    yield key, builder.value
                    key, builder = None, None


def copy_of(trace: MemoryTrace) -> ChromeTraceCopy:
    """The Chrome trace `trace` was read from; one clear error for any other input."""
    if trace.source_kind != KINETO:
        raise UnsupportedFormat(trace.source_path, "--export-trace adds counters to a PyTorch Profiler (Kineto) "
                                "trace, and this input is not one", "Pass the .json or .json.gz trace itself.")
    return ChromeTraceCopy(Path(trace.source_path))
