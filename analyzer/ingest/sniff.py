"""Tell the format of an input from its bytes, not its name, and open it (gunzipped, size-limited).

Users rename files freely (`.pkl`, `.pickle`, `.json.gz`, no suffix at all), so the suffix is never trusted.
"""
from __future__ import annotations

import gzip
import io
import os
import re
import tarfile
import zlib
from pathlib import Path
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import IO

from analyzer.errors import CorruptInput, InputNotFound, ResourceLimit, UnsupportedFormat
from analyzer.ingest.log.detect import json_list, text_log

#: decompressed bytes we accept from one gzip member stream; set ANALYZER_MAX_DECOMPRESSED_BYTES to change
DEFAULT_MAX_DECOMPRESSED_BYTES = 32 * 2**30
#: decompressed bytes per compressed byte past which a stream is taken for a gzip bomb, once RATIO_FLOOR_BYTES
#: have come out (real traces and snapshots expand 5-30 times, deflate at most ~1000); set
#: ANALYZER_MAX_COMPRESSION_RATIO to change
DEFAULT_MAX_COMPRESSION_RATIO = 200
RATIO_FLOOR_BYTES = 64 << 20

SNAPSHOT = "snapshot"
KINETO = "kineto"
MEMORY_TIMELINE = "memory_timeline"
MEMORY_TIMELINE_RAW = "memory_timeline_raw"
NSYS_SQLITE = "nsys_sqlite"
NSYS_REP = "nsys_rep"
TRACE_ARCHIVE = "trace_archive"
TRACE_DIRECTORY = "trace_directory"
LOG = "log"  # a text log: analyzer.log_result reads it

_GZIP_MAGIC = b"\x1f\x8b"
_SQLITE_MAGIC = b"SQLite format 3\x00"
_NSYS_REP_MAGIC = b"NVIDIA Tegra Profiler Report"
# Opcodes a protocol 0/1 pickle can start with (protocol >= 2 starts with PROTO, 0x80).
_PICKLE_V0_FIRST = set(b"(]}NIJKLMFSVXUBTCcigGh.)0lodpsabet")
_RAW_TIMELINE_ROW = re.compile(rb"^\s*\[\s*\[\s*-?\d+(\.\d+)?\s*,\s*\d+\s*,\s*-?\d+\s*,\s*-?\d+\s*\]\s*,?")


def max_decompressed_bytes() -> int:
    return int(os.environ.get("ANALYZER_MAX_DECOMPRESSED_BYTES", DEFAULT_MAX_DECOMPRESSED_BYTES))


def max_compression_ratio() -> int:
    return int(os.environ.get("ANALYZER_MAX_COMPRESSION_RATIO", DEFAULT_MAX_COMPRESSION_RATIO))


def gunzip(compressed: IO[bytes], path: str) -> IO[bytes]:
    """A buffered stream of the gzip data in `compressed`, stopped by both limits above."""
    return io.BufferedReader(_LimitedReader(gzip.GzipFile(fileobj=compressed), compressed, path), buffer_size=1 << 20)


class _LimitedReader(io.RawIOBase):
    """Counts decompressed bytes and stops a gzip bomb: at the configured size, or as soon as the stream has
    expanded past the configured ratio (so a small bomb is stopped after RATIO_FLOOR_BYTES, not after
    gigabytes that a pickle would hold in memory)."""

    def __init__(self, inner: gzip.GzipFile, compressed: IO[bytes], path: str) -> None:
        self._inner, self._compressed, self._path, self._count = inner, compressed, path, 0
        self._limit, self._ratio = max_decompressed_bytes(), max_compression_ratio()

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        try:
            n = self._inner.readinto(buffer)
        except (OSError, EOFError, zlib.error) as error:
            raise CorruptInput(self._path, f"the gzip stream is damaged ({error})", "Compress the file again or pass it uncompressed.") from None
        self._count += n
        if self._count > self._limit:
            raise ResourceLimit(self._path, f"decompresses to more than {self._limit} bytes",
                                "Raise ANALYZER_MAX_DECOMPRESSED_BYTES if the file is genuine.")
        if self._count > RATIO_FLOOR_BYTES and self._count > self._ratio * max(self._compressed.tell(), 1):
            raise ResourceLimit(self._path, f"decompresses to more than {self._ratio} times its compressed size "
                                "(a gzip bomb?)", "Raise ANALYZER_MAX_COMPRESSION_RATIO if the file is genuine.")
        return n

    def close(self) -> None:
        self._inner.close()
        super().close()


def check_path(path: str | Path) -> Path:
    """The path exists, is readable and is not empty; directories are allowed (sets of per-rank traces)."""
    p = Path(path)
    if not p.exists():
        raise InputNotFound(p, "no such file", "Check the path.")
    if p.is_dir():
        return p
    if not os.access(p, os.R_OK):
        raise InputNotFound(p, "the file cannot be read (permission denied)")
    if p.stat().st_size == 0:
        raise CorruptInput(p, "the file is empty", "The recording was probably interrupted before it was written.")
    return p


#: called with (file object, size in bytes) whenever an input is opened, so the CLI can show progress
OPEN_LISTENERS: list[Callable[[IO[bytes], int], None]] = []


#: path -> a descriptor the parent process opened and showed to the listeners, for the reader in the child
#: (analyzer.ingest.confined) to read through: a duplicate shares its offset, which the progress bar polls
_WATCHED: dict[Path, int] = {}


@contextmanager
def watched(path: Path) -> Iterator[None]:
    """Show `path` to the OPEN_LISTENERS here, for a child process that reads it inside the block."""
    if path.is_dir() or not OPEN_LISTENERS:
        yield
        return
    with open(path, "rb") as raw:
        for listener in OPEN_LISTENERS:
            listener(raw, path.stat().st_size)
        _WATCHED[path] = raw.fileno()
        try:
            yield
        finally:
            _WATCHED.pop(path, None)


def open_input(path: Path) -> IO[bytes]:
    """A buffered binary stream of the file's content, gunzipped when it is gzip."""
    shared = _WATCHED.pop(path, None)
    if shared is not None:
        raw = open(os.dup(shared), "rb")
        raw.seek(0)
    else:
        raw = open(path, "rb")
        for listener in OPEN_LISTENERS:
            listener(raw, path.stat().st_size)
    if raw.peek(2)[:2] == _GZIP_MAGIC:
        return gunzip(raw, str(path))
    return raw


def sniff(path: Path) -> str:
    """The kind of input at `path` (one of the constants above)."""
    if path.is_dir():
        return TRACE_DIRECTORY
    with open(path, "rb") as f:
        magic = f.read(64)
    if magic.startswith(_SQLITE_MAGIC):
        return NSYS_SQLITE
    if magic.startswith(_NSYS_REP_MAGIC):
        return NSYS_REP
    if magic.startswith(_GZIP_MAGIC) and _is_tar(path):
        return TRACE_ARCHIVE
    with open_input(path) as stream:
        head = stream.peek(1 << 16)[: 1 << 16] if hasattr(stream, "peek") else stream.read(1 << 16)
    if not head:
        raise CorruptInput(path, "the file is empty once decompressed")
    first = head.lstrip()[:1]
    if first not in (b"{", b"[") and head[:1] != b"\x80" and text_log(head):
        return LOG
    if head[:1] == b"\x80" or (head[:1] and head[0] in _PICKLE_V0_FIRST and first not in (b"{", b"[")):
        return SNAPSHOT
    if first == b"{":
        return KINETO
    if first == b"[":
        if not json_list(head) and text_log(head):
            return LOG
        return MEMORY_TIMELINE_RAW if _RAW_TIMELINE_ROW.match(head) else MEMORY_TIMELINE
    raise UnsupportedFormat(path, "not a memory snapshot, profiler trace, memory timeline or Nsight export",
                            "Pass a torch.cuda.memory._dump_snapshot pickle, a Kineto .json(.gz), or an nsys .sqlite export.")


def _is_tar(path: Path) -> bool:
    try:
        with tarfile.open(path, "r:gz") as archive:
            return archive.next() is not None
    except (tarfile.TarError, OSError, EOFError, zlib.error):
        return False
