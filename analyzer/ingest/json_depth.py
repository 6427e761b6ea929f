"""Refuse JSON nested deeper than ANALYZER_MAX_NESTING, before the parser sees the bytes.

ijson keeps a path string for every open level ("traceEvents.item.args.item.item..."), so its memory and
time grow with the square of the depth: 200 KB of brackets asks for tens of GB. Profiler traces and memory
timelines nest fewer than ten levels. `DepthLimitedStream` wraps the stream the parser reads and tracks the
depth chunk by chunk (brackets inside strings, and escaped quotes, do not count), mostly in C: a fraction of
the parser's own time.
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
_STEP = np.zeros(256, dtype=np.int64)
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
        """Escapes are cut out (a regular expression, in C), then everything but quotes and brackets; the
        quotes split what is left into outside and inside strings, and numpy walks the outside brackets."""
        if self._escaped:  # the previous chunk ended in the backslash that escapes this byte
            chunk = chunk[1:]
        chunk = _ESCAPE.sub(b"", chunk)
        self._escaped = chunk.endswith(b"\\")  # only a last, lone backslash survives the substitution
        parts = chunk.translate(None, _NOT_STRUCTURE).split(b'"')
        brackets = b"".join(parts[int(self._in_string)::2])
        self._in_string ^= len(parts) % 2 == 0
        if not brackets:
            return
        depths = self._depth + np.cumsum(_STEP[np.frombuffer(brackets, dtype=np.uint8)])
        if int(depths.max()) > self._limit:
            raise ResourceLimit(self._path, f"the JSON nests deeper than {self._limit} levels",
                                "Raise ANALYZER_MAX_NESTING if the file is genuine.")
        self._depth = int(depths[-1])
