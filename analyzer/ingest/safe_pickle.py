"""Load an untrusted pickle without ever executing anything it names.

Snapshot pickles hold only dicts, lists, tuples, strings, numbers, booleans and None, so an unpickler
that refuses every global (GLOBAL, STACK_GLOBAL, INST, OBJ, NEWOBJ, REDUCE all need one) and every
persistent id loses nothing and cannot be made to import or call code. This subclass keeps the C
unpickler (only `find_class` and `persistent_load` are overridden), so it is as fast as `pickle.load`.
"""
from __future__ import annotations

import io
import pickle
from typing import IO, Any

from analyzer.errors import CorruptInput, ResourceLimit, UnsafePickle


class _RefusingUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise UnsafePickle(None, f"the pickle asks to import {module}.{name}; snapshots never need code, so it was refused",
                           "Only load snapshots written by torch.cuda.memory._dump_snapshot.")

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafePickle(None, "the pickle uses persistent ids, which snapshots never contain")


def load_untrusted(stream: IO[bytes], path: str) -> Any:
    """Unpickle `stream` refusing all code; every failure becomes one AnalyzerError naming `path`."""
    try:
        return _RefusingUnpickler(stream).load()
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
