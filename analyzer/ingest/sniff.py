"""Tell the format of an input from its bytes, not its name, and open it (gunzipped, size-limited).

Users rename files freely (`.pkl`, `.pickle`, `.json.gz`, no suffix at all), so the suffix is never trusted.
"""
from __future__ import annotations

import gzip
import io
import os
import re
import stat
import tarfile
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
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
#: bytes a tar header extension (a GNU long name or link, pax attributes) may declare: tarfile reads one whole
#: before the member it describes, so a 3.5 MB .tar.gz declaring 3.5 GiB was read into memory while sniffing
MAX_TAR_HEADER_BYTES = 1 << 20
_TAR_EXTENSIONS = {tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK, tarfile.XHDTYPE, tarfile.XGLTYPE,
                   tarfile.SOLARIS_XHDTYPE}

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
    gigabytes that a pickle would hold in memory), as a whole or over any RATIO_FLOOR_BYTES it decompressed
    since the last check (an incompressible prefix would otherwise pay for a bomb behind it: 4 MB of random
    bytes, then 600M pickled `None`s, expand 130 times as a whole and 1000 times after the prefix)."""

    def __init__(self, inner: gzip.GzipFile, compressed: IO[bytes], path: str) -> None:
        self._inner, self._compressed, self._path, self._count = inner, compressed, path, 0
        self._limit, self._ratio = max_decompressed_bytes(), max_compression_ratio()
        self._window = (0, 0)   # decompressed and compressed bytes at the last check of a window

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
        if self._count - self._window[0] >= RATIO_FLOOR_BYTES:
            consumed = self._compressed.tell()
            if self._count - self._window[0] > self._ratio * max(consumed - self._window[1], 1):
                raise ResourceLimit(self._path, f"decompresses to more than {self._ratio} times its compressed "
                                    f"size over {RATIO_FLOOR_BYTES >> 20} MiB (a gzip bomb?)",
                                    "Raise ANALYZER_MAX_COMPRESSION_RATIO if the file is genuine.")
            self._window = (self._count, consumed)
        if self._count > RATIO_FLOOR_BYTES and self._count > self._ratio * max(self._compressed.tell(), 1):
            raise ResourceLimit(self._path, f"decompresses to more than {self._ratio} times its compressed size "
                                "(a gzip bomb?)", "Raise ANALYZER_MAX_COMPRESSION_RATIO if the file is genuine.")
        return n

    def compressed_bytes(self) -> int:
        """Compressed bytes read so far (what the snapshot reader weighs the unpickled objects against)."""
        return self._compressed.tell()

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
        raw = open_regular(path)
        for listener in OPEN_LISTENERS:
            listener(raw, path.stat().st_size)
    if raw.peek(2)[:2] == _GZIP_MAGIC:
        return gunzip(raw, str(path))
    return raw


def open_regular(path: Path) -> io.BufferedReader:
    """`path` opened for reading if it is a regular file; opening never blocks (a FIFO put where a file was,
    between listing a folder and reading it, would block an open for ever), and anything else is one error."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UnsupportedFormat(path, "is not a regular file", "Pass a recording saved to a file.")
    return open(fd, "rb")


def sniff(path: Path) -> str:
    """The kind of input at `path` (one of the constants above)."""
    if path.is_dir():
        return TRACE_DIRECTORY
    with open_regular(path) as f:
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
    if head[:1] != b"\x80" and first not in (b"{", b"["):
        looks = looks_like(head)
        if looks is not None and not looks.startswith(TEXT_KINDS):   # an image, a page: not a log either
            raise UnsupportedFormat(path, f"looks like {looks}, not a recording of GPU memory or a log", ACCEPTED)
        if text_log(head):
            return LOG   # text, CSV (nvidia-smi's): the log reader says what it finds, or what it looked for
    if head[:1] == b"\x80" or (head[:1] and head[0] in _PICKLE_V0_FIRST and first not in (b"{", b"[")):
        return SNAPSHOT
    if first == b"{":
        return KINETO
    if first == b"[":
        if not json_list(head) and text_log(head):
            return LOG
        return MEMORY_TIMELINE_RAW if _RAW_TIMELINE_ROW.match(head) else MEMORY_TIMELINE
    raise UnsupportedFormat(path, "not a memory snapshot, profiler trace, memory timeline or Nsight export", ACCEPTED)


#: what `analyze` reads, said whenever a file is none of it
ACCEPTED = ("analyze reads a CUDA memory snapshot (a torch.cuda.memory._dump_snapshot pickle), a PyTorch Profiler "
            "trace (.json or .json.gz with traceEvents), an export_memory_timeline file, an Nsight Systems .sqlite "
            "export, or a training log holding an out-of-memory message, memory_summary(), nvidia-smi or framework "
            "memory lines.")
#: the first bytes of files people pass by mistake, and what they are
_MAGIC = ((b"\x89PNG\r\n\x1a\n", "a PNG image"), (b"\xff\xd8\xff", "a JPEG image"), (b"GIF87a", "a GIF image"),
          (b"GIF89a", "a GIF image"), (b"%PDF-", "a PDF document"),
          (b"PK\x03\x04", "a zip archive (torch.save writes these: a model or tensors, not a memory recording)"))
_MARKUP = ((b"<!doctype html", "an HTML page"), (b"<html", "an HTML page"), (b"<svg", "an SVG image"),
           (b"<?xml", "an XML document"))
#: how a protocol 0 pickle (text) opens: a dict, list or tuple (`(dp0`), a global (`cmodule\nname\n`), a string,
#: an int or None; such a file goes to the pickle reader, which refuses globals and says what is truncated
_PICKLE_V0_TEXT = re.compile(rb"^(?:\((?:dp|lp|t)\d*\n|\(?c[\w.]+\n[\w.]+\n|\(?S'[^\n]*'\n|I-?\d+(?:\n|$)"
                             rb"|L-?\d+L?(?:\n|$)|F-?[\d.eE+-]+\n|N\.|\)\.|\(t)")


def looks_like(head: bytes) -> str | None:
    """What the start of a file that is no recording looks like (an image, HTML, CSV, text), or None when it may
    still be a protocol 0/1 pickle (binary, or the text such a pickle opens with)."""
    for magic, what in _MAGIC:
        if head.startswith(magic):
            return what
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "a WebP image"
    start = head.lstrip()[:64].lower()
    for markup, what in _MARKUP:
        if start.startswith(markup):
            return what
    if b"\0" in head or _PICKLE_V0_TEXT.match(head):
        return None
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError as error:
        if error.start < len(head) - 4:   # not just a character cut at the end of the head
            return None
        text = head[: error.start].decode("utf-8")
    return text_kind(text)


#: how text_kind names plain text: such a file goes to the log reader
TEXT_KINDS = ("CSV", "tab-separated", "text")


def text_kind(text: str) -> str:
    """What a text file looks like: CSV when its first lines split alike on one delimiter, else text, quoting its
    first line."""
    if text.startswith("\ufeff") and text[1:].lstrip()[:1] in ("{", "["):
        return "JSON behind a byte-order mark (JSON has none: write it again without one)"
    lines = [line for line in text.splitlines()[:5] if line.strip()]
    for delimiter, name in ((",", "CSV"), ("\t", "tab-separated values")):
        counts = {line.count(delimiter) for line in lines}
        if len(lines) >= 2 and len(counts) == 1 and counts != {0}:
            return f"{name} (text in columns)"
    first = lines[0].strip() if lines else ""
    return "text" + (f" (it starts {first[:60]!r})" if first else "")


def _is_tar(path: Path) -> bool:
    """The gzip stream starts with a valid tar header (its checksum holds); only that first block is read."""
    try:
        with open_regular(path) as raw, gunzip(raw, str(path)) as stream:
            tarfile.TarInfo.frombuf(stream.read(tarfile.BLOCKSIZE), "utf-8", "surrogateescape")
        return True
    except (tarfile.HeaderError, CorruptInput, ResourceLimit, OSError, EOFError, zlib.error):
        return False


class BoundedTarInfo(tarfile.TarInfo):
    """A tar member whose header extension is refused past MAX_TAR_HEADER_BYTES before tarfile reads it (pass as
    `tarfile.open(..., tarinfo=BoundedTarInfo)`)."""

    def _proc_member(self, archive: tarfile.TarFile) -> tarfile.TarInfo:
        if self.type in _TAR_EXTENSIONS and self.size > MAX_TAR_HEADER_BYTES:
            raise ResourceLimit(os.fsdecode(archive.name or ""), f"a header of the archive declares {self.size} bytes of name or "
                                f"attributes (tar writes a few hundred; at most {MAX_TAR_HEADER_BYTES} are read)",
                                "Create the archive again with tar -czf.")
        return super()._proc_member(archive)  # type: ignore[misc]
