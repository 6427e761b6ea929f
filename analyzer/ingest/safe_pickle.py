"""Load an untrusted pickle without ever executing anything it names.

Snapshot pickles hold only dicts, lists, tuples, strings, numbers, booleans and None, so an unpickler
that refuses every global (GLOBAL, STACK_GLOBAL, INST, OBJ, NEWOBJ, REDUCE all need one) and every
persistent id loses nothing and cannot be made to import or call code. This subclass keeps the C
unpickler (only `find_class` and `persistent_load` are overridden), so it is as fast as `pickle.load`.
"""
from __future__ import annotations

import io
import os
import pickle
import resource
from collections.abc import Callable
from typing import IO, Any

from analyzer.errors import CorruptInput, ResourceLimit, UnsafePickle


class _RefusingUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise UnsafePickle(None, f"the pickle asks to import {module}.{name}; snapshots never need code, so it was refused",
                           "Only load snapshots written by torch.cuda.memory._dump_snapshot.")

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafePickle(None, "the pickle uses persistent ids, which snapshots never contain")


#: resident memory the unpickled objects of a gzipped pickle may take per compressed byte read, past
#: MEMORY_FLOOR. The C unpickler cannot count the objects it makes, but what they take is read at each of its reads
#: (every 64-128 KiB). The 7 real snapshots over 1 MB take 2.5-6.1 bytes per pickle byte and gzip 14-30 times:
#: 49-87 bytes per compressed byte (the real-derived benchmark, 100,000 or 1M entries: 61); the worst of both, 6.1
#: bytes and 34 times, would be 209. Smaller files take up to 12 bytes per pickle byte, far under the floor. A list
#: of references (`N`, one pickle byte: 8 bytes of memory) compressed 190 times, under the ratio limit, takes some
#: 3,000. See docs/design/hostile-inputs.md (ANALYZER_MAX_PICKLE_MEMORY_RATIO sets it)
MEMORY_PER_COMPRESSED_BYTE = 400
MEMORY_FLOOR = 256 << 20


def _resident() -> int:
    """This process's resident memory (0 where /proc is not: no check)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * resource.getpagesize()
    except OSError:
        return 0


class _Watched:
    """`stream` as the unpickler reads it, checking at every read what its objects take per compressed byte."""

    def __init__(self, stream: IO[bytes], compressed: Callable[[], int], path: str) -> None:
        self._stream, self._compressed, self._path = stream, compressed, path
        self._start, self._ratio = _resident(), int(os.environ.get("ANALYZER_MAX_PICKLE_MEMORY_RATIO",
                                                                   MEMORY_PER_COMPRESSED_BYTE))

    def _check(self) -> None:
        grown, read = _resident() - self._start, self._compressed()
        if grown > MEMORY_FLOOR + self._ratio * read:
            raise ResourceLimit(self._path, f"its objects took {grown >> 20} MiB from {read >> 10} KiB of gzip, more "
                                f"than {self._ratio} bytes of memory per compressed byte (millions of references?)",
                                "Raise ANALYZER_MAX_PICKLE_MEMORY_RATIO if the file is genuine.")

    def read(self, n: int = -1) -> bytes:
        self._check()
        return self._stream.read(n)

    def readinto(self, buffer: Any) -> int:
        self._check()
        return self._stream.readinto(buffer)  # type: ignore[attr-defined]

    def readline(self, n: int = -1) -> bytes:
        self._check()
        return self._stream.readline(n)

    def peek(self, n: int = 0) -> bytes:
        return self._stream.peek(n)  # type: ignore[attr-defined]


def load_untrusted(stream: IO[bytes], path: str) -> Any:
    """Unpickle `stream` refusing all code; every failure becomes one AnalyzerError naming `path`. A gzip stream
    (analyzer.ingest.sniff.gunzip) is watched for what its objects take (MEMORY_PER_COMPRESSED_BYTE)."""
    compressed = getattr(getattr(stream, "raw", None), "compressed_bytes", None)
    try:
        return _RefusingUnpickler(_Watched(stream, compressed, path) if compressed else stream).load()
    except UnsafePickle as error:
        error.path = path
        raise UnsafePickle(path, error.problem, error.hint) from None
    except RecursionError:
        raise ResourceLimit(path, "the pickle is nested too deeply to be a snapshot") from None
    except MemoryError:
        raise ResourceLimit(path, "the pickle needs more memory than reading may take (analyzer.ingest.confined)",
                            "Raise ANALYZER_MAX_READ_MEMORY (e.g. 16GiB) if the file is genuine.") from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError, KeyError,
            AttributeError, OverflowError, UnicodeDecodeError, io.UnsupportedOperation) as error:
        raise CorruptInput(path, f"not a readable pickle ({type(error).__name__}: {str(error)[:120]})",
                           "The file may be truncated; dump it again with torch.cuda.memory._dump_snapshot().") from None
