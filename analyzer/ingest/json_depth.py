"""Refuse JSON nested deeper than ANALYZER_MAX_NESTING, before the parser sees the bytes.

ijson keeps a path string for every open level ("traceEvents.item.args.item.item..."), so its memory and
time grow with the square of the depth: 200 KB of brackets asks for tens of GB. Profiler traces and memory
timelines nest fewer than ten levels. `DepthLimitedStream` wraps the stream the parser reads and tracks the
depth chunk by chunk (brackets inside strings, and escaped quotes, do not count) with bytes methods and numpy,
never an object per string: a small fraction of the parser's own time.
"""
from __future__ import annotations

import os
import re
from typing import IO

import numpy as np

from analyzer.errors import ResourceLimit

#: deepest JSON nesting we read; set ANALYZER_MAX_NESTING to change
DEFAULT_MAX_NESTING = 64

_ESCAPE = re.compile(rb"\\.", re.DOTALL)  # a backslash and the byte it escapes (JSON has them only in strings)
_NOT_STRUCTURE = bytes(c for c in range(256) if c not in b'"[]{}')
_QUOTE = ord('"')
_STEP = np.zeros(256, dtype=np.int8)
_STEP[[ord("["), ord("{")]], _STEP[[ord("]"), ord("}")]] = 1, -1


def max_nesting() -> int:
    return int(os.environ.get("ANALYZER_MAX_NESTING", DEFAULT_MAX_NESTING))


class DepthLimitedStream:
    """A read-only byte stream that raises ResourceLimit once the JSON in it nests deeper than the limit."""

    def __init__(self, stream: IO[bytes], path: str, limit: int | None = None) -> None:
        self._stream, self._path = stream, path
        self._limit = max_nesting() if limit is None else limit
        self._depth = 0
        self._in_string = False
        self._escaped = False  # the previous chunk ended in a backslash whose escaped byte is still to come

    def read(self, size: int = -1) -> bytes:
        chunk = self._stream.read(size)
        if chunk:
            self._scan(chunk)
        return chunk

    def _scan(self, chunk: bytes) -> None:
        """Escapes are cut out (a regular expression, in C, only when the chunk has a backslash), then everything
        but quotes and brackets; a running XOR of the quotes says which brackets sit inside strings, and the
        others are summed in small integers (a 1 MiB chunk is a few hundred thousand marks)."""
        if self._escaped:  # the previous chunk ended in the backslash that escapes this byte
            chunk = chunk[1:]
        if b"\\" in chunk:
            chunk = _ESCAPE.sub(b"", chunk)
        self._escaped = chunk.endswith(b"\\")  # only a last, lone backslash survives the substitution
        marks = np.frombuffer(chunk.translate(None, _NOT_STRUCTURE), dtype=np.uint8)
        if not len(marks):
            return
        quotes = marks == _QUOTE
        inside = np.bitwise_xor.accumulate(quotes.view(np.uint8)) ^ np.uint8(self._in_string)
        brackets = ~quotes  # a bracket leaves the parity as it was before it
        steps = _STEP[marks[brackets]] * (1 - inside[brackets]).astype(np.int8)
        self._in_string = bool(inside[-1])
        if not len(steps):
            return
        depths = self._depth + np.cumsum(steps, dtype=np.int64)
        if int(depths.max()) > self._limit:
            raise ResourceLimit(self._path, f"the JSON nests deeper than {self._limit} levels",
                                "Raise ANALYZER_MAX_NESTING if the file is genuine.")
        self._depth = int(depths[-1])
