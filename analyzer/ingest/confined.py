"""Read an untrusted input in a child process with CPU-time and memory limits, so that no file can hang the
analyzer or take the machine's memory, whatever its bytes expand to.

Some costs are out of any reader's reach: CPython's unpickler hashes tuples used as dict keys itself (sixty
levels of shared `(t, t)` take exponential time before our code runs), and a few kilobytes can expand into
millions of entries through references. The child (a fork: nothing is imported again) runs the reader under
RLIMIT_CPU and RLIMIT_AS and sends back the MemoryTrace it built, pickled by our own code; a child stopped by a
limit becomes one ResourceLimit naming the limit and its environment variable. Where fork is not available the
reader runs in-process, as before.

Cost, measured on the 1M-entry benchmark snapshot (benchmarks/bench_snapshot.py): see docs/design/hostile-inputs.md.
"""
from __future__ import annotations

import os
import pickle
import resource
import signal
import struct
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar, cast

from analyzer import errors
from analyzer.core.units import parse_bytes
from analyzer.errors import AnalyzerError, ResourceLimit
from analyzer.ingest import sniff

T = TypeVar("T")

#: CPU seconds a read may take: this much for any file, plus CPU_SECONDS_PER_MIB per MiB it expands to (reading
#: runs at ~40 MiB a CPU second, so a genuine file has 40 times the time it needs, and a small one a few seconds:
#: an 80-byte pickle of nested tuple keys ran 20 s before the limit); ANALYZER_MAX_READ_SECONDS sets a fixed
#: limit instead
BASE_CPU_SECONDS = 5
CPU_SECONDS_PER_MIB = 1.0
#: memory a read may take: at least this, or MEMORY_PER_BYTE times what the input expands to (the 1M-entry
#: benchmark takes 5 times its pickle's size); ANALYZER_MAX_READ_MEMORY sets a fixed limit instead (e.g. 8GiB)
BASE_MEMORY = 3 * 2**30
MEMORY_PER_BYTE = 16
#: wall-clock time a read may take, per CPU second it may use, plus a slack: a reader stuck waiting uses no CPU
WALL_SECONDS_PER_CPU_SECOND = 3
WALL_SECONDS_SLACK = 30


def cpu_limit(path: Path) -> int:
    fixed = os.environ.get("ANALYZER_MAX_READ_SECONDS")
    if fixed:
        return max(1, int(float(fixed)))
    return int(BASE_CPU_SECONDS + CPU_SECONDS_PER_MIB * _expanded_size(path) / 2**20)


def memory_limit(path: Path) -> int:
    fixed = os.environ.get("ANALYZER_MAX_READ_MEMORY")
    if fixed:
        return parse_bytes(fixed)
    return max(BASE_MEMORY, MEMORY_PER_BYTE * _expanded_size(path))


def _size(path: Path) -> int:
    if path.is_dir():
        return sum(p.stat().st_size for p in path.iterdir() if p.is_file())
    return path.stat().st_size


def _expanded_size(path: Path) -> int:
    """The bytes the input holds once decompressed, as far as can be told without decompressing: a gzip file's
    trailer (size modulo 4 GiB), never more than the compression ratio limit allows."""
    size = _size(path)
    if path.is_dir() or size < 18:
        return size
    with open(path, "rb") as f:
        if f.read(2) != b"\x1f\x8b":
            return size
        f.seek(-4, os.SEEK_END)
        stated = struct.unpack("<I", f.read(4))[0]
    return max(size, min(stated, sniff.max_compression_ratio() * size))


def confined(read: Callable[[], T], path: Path) -> T:
    """`read()` in a child process under the CPU and memory limits for `path`; its result, or its AnalyzerError."""
    if not hasattr(os, "fork"):
        return read()
    seconds, memory = cpu_limit(path), memory_limit(path)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns, never runs the parent's cleanup
        os.close(r)
        code = 0
        try:
            sniff.OPEN_LISTENERS.clear()
            _limit(seconds, memory)
            with os.fdopen(w, "wb") as out:
                try:
                    message: tuple = ("ok", read())
                except AnalyzerError as error:
                    message = ("error", type(error).__name__, error.path, error.problem, error.hint)
                except MemoryError:
                    message = ("memory",)
                except BaseException as error:  # a bug of ours: the parent reports it as one
                    message = ("bug", f"{type(error).__name__}: {error}", traceback.format_exc())
                pickle.dump(message, out, protocol=pickle.HIGHEST_PROTOCOL)
        except MemoryError:
            code = 3
        except BaseException:
            code = 4
        finally:
            os._exit(code)
    os.close(w)
    # CPU time stops a child that computes; a child that waits (a lock another thread of the parent held when it
    # forked) spends none, so a wall-clock deadline ends it too
    watchdog = threading.Timer(WALL_SECONDS_PER_CPU_SECOND * seconds + WALL_SECONDS_SLACK, _kill, (pid,))
    watchdog.daemon = True
    watchdog.start()
    try:
        with os.fdopen(r, "rb") as result:
            # the child's own objects (a MemoryTrace of numpy columns), made by this package's code: trusted
            message = pickle.load(result)
    except (EOFError, pickle.UnpicklingError, OSError):
        message = ("died",)
    finally:
        _, status = os.waitpid(pid, 0)
        watchdog.cancel()
    if _killed.pop(pid, False) and message == ("died",):
        raise ResourceLimit(path, f"reading it did not finish within {WALL_SECONDS_PER_CPU_SECOND * seconds + WALL_SECONDS_SLACK} s "
                                  "of wall-clock time (the reader was stuck)",
                            "Raise ANALYZER_MAX_READ_SECONDS if the file is genuine and the machine is busy.")
    return cast(T, _outcome(message, status, path, seconds, memory))


_killed: dict[int, bool] = {}


def _kill(pid: int) -> None:
    _killed[pid] = True
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _limit(seconds: int, memory: int) -> None:
    """RLIMIT_CPU past `seconds` (SIGXCPU, then SIGKILL) and address space `memory` beyond what the fork holds."""
    soft, hard = resource.getrlimit(resource.RLIMIT_CPU)
    resource.setrlimit(resource.RLIMIT_CPU, (seconds, seconds + 2 if hard == resource.RLIM_INFINITY else min(hard, seconds + 2)))
    with open("/proc/self/statm") as f:
        held = int(f.read().split()[0]) * resource.getpagesize()
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    wanted = held + memory
    resource.setrlimit(resource.RLIMIT_AS, (wanted if hard == resource.RLIM_INFINITY else min(wanted, hard), hard))


def _outcome(message: tuple, status: int, path: Path, seconds: int, memory: int) -> Any:
    kind = message[0]
    if kind == "ok":
        return message[1]
    if kind == "error":
        cls = getattr(errors, message[1], AnalyzerError)
        raise cls(message[2], message[3], message[4])
    if kind == "bug":
        if os.environ.get("ANALYZER_DEBUG"):
            print(message[2])
        raise RuntimeError(f"while reading {path}: {message[1]}")
    if kind == "memory" or (os.WIFEXITED(status) and os.WEXITSTATUS(status) == 3):
        raise ResourceLimit(path, f"reading it needs more than {memory / 2**30:.1f} GiB of memory (what a few bytes "
                                  "expand to: shared references, entries, strings)",
                            "Raise ANALYZER_MAX_READ_MEMORY (e.g. 16GiB) if the file is genuine.")
    if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGXCPU:
        raise ResourceLimit(path, f"reading it took more than {seconds} s of CPU time (a pickle built to make the "
                                  "unpickler hash deep tuples, or to expand into millions of entries?)",
                            "Raise ANALYZER_MAX_READ_SECONDS if the file is genuine.")
    raise ResourceLimit(path, f"the reader stopped without a result ({_status(status)}: out of memory or CPU time?)",
                        "Raise ANALYZER_MAX_READ_MEMORY or ANALYZER_MAX_READ_SECONDS if the file is genuine.")


def _status(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"signal {signal.Signals(os.WTERMSIG(status)).name}"
    return f"exit status {os.WEXITSTATUS(status)}"

