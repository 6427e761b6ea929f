"""Generators of issue 20's hostile classes, each sized by a parameter so a test can build it at N and 2N:
amplification through a pickle's memo, tuples as dict keys, SQLite generated columns, quadratic shapes (open
ranges, stacks sharing their probe frames, deep module names, huge strings), planted links at the default
report path, and terminal controls in every string the CLI prints."""
from __future__ import annotations

import gzip
import pickle
import sqlite3
import struct
import tempfile
from pathlib import Path
from typing import Any

from tests.hostile.generators import _NSYS_SCHEMA
from tests.support.snapshots import MiB, Recording

#: every control a terminal obeys or a reader is fooled by: CR, erase line, OSC 0 (title), OSC 52 (clipboard),
#: C1 CSI, NEL, line and paragraph separators, a bidi override, NUL
CONTROLS = ["\r", "\x1b[2K", "\x1b]0;pwned\x07", "\x1b]52;c;ZXZpbA==\x07", "\x9b31m", "\x85", "\u2028", "\u2029",
            "\u202e", "\x00", "\nreport written to ok.html\n"]
RAW = set("\r\x1b\x9b\x85\u2028\u2029\u202e\x00\x07")


def small_snapshot() -> dict[str, Any]:
    rec = Recording()
    with rec.step(1), rec.phase("forward"):
        rec.alloc(4 * MiB)
    return rec.snapshot()


def memo_amplified(references: int) -> bytes:
    """A gzipped snapshot whose trace is one entry dict referenced `references` times through the pickle's memo:
    a few bytes a reference, however many entries it expands to."""
    data = small_snapshot()
    entry = data["device_traces"][0][0]
    data["device_traces"][0] = [entry] * references
    return gzip.compress(pickle.dumps(data, protocol=4), 9)


def tuple_keys(levels: int) -> bytes:
    """A snapshot whose allocator settings are keyed by `levels` of shared `(t, t)` tuples: the unpickler hashes
    the key itself, in time exponential in `levels`, before any reader code runs. Written opcode by opcode (Python
    would hash the key to build the dict), memoized at indices the pickler never uses."""
    data = small_snapshot()
    data["allocator_settings"] = {"__KEY__": 1}
    body = pickle.dumps(data, protocol=2)
    placeholder = b"X" + struct.pack("<I", 7) + b"__KEY__"
    base = 1 << 20
    key = b")" + b"r" + struct.pack("<I", base) + b"0"            # EMPTY_TUPLE, LONG_BINPUT, POP
    for level in range(levels):
        get = b"j" + struct.pack("<I", base + level)               # LONG_BINGET
        key += get + get + b"\x86" + b"r" + struct.pack("<I", base + level + 1) + b"0"   # TUPLE2, put, pop
    assert body.count(placeholder) == 1
    return body.replace(placeholder, key + b"j" + struct.pack("<I", base + levels))


def nsys_with_generated(table: str, column: str, expression: str) -> bytes:
    """The minimal Nsight export of the hostile generators, with `table.column` (StringIds.value or
    NVTX_EVENTS.text) a VIRTUAL generated column of `expression`, added once the rows are in (an insert would
    evaluate it): PRAGMA table_info hides it, and any query that names it evaluates it on every row."""
    declared = next(line for line in _NSYS_SCHEMA.splitlines() if line.startswith(f"CREATE TABLE {table} "))
    schema = "\n".join(line for line in _NSYS_SCHEMA.replace(declared, declared.replace(f", {column} TEXT", "")).splitlines()
                       if not line.startswith(f"INSERT INTO {table} "))
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "export.sqlite"
        db = sqlite3.connect(path)
        db.executescript(schema)
        db.execute("INSERT INTO StringIds (id) VALUES (1)" if table == "StringIds" else
                   "INSERT INTO StringIds VALUES (1, 'step')")
        db.execute("INSERT INTO CUDA_GPU_MEMORY_USAGE_EVENTS VALUES (1000, ?, 0, ?, 1048576, 1, 0)",
                   (4242 << 24, 0x7F0000000000))
        db.execute('INSERT INTO NVTX_EVENTS (start, "end", eventType, globalTid, textId) VALUES (0, 5, 59, ?, 1)',
                   ((4242 << 24) + 4242,))
        db.execute(f"ALTER TABLE {table} ADD COLUMN {column} TEXT GENERATED ALWAYS AS ({expression}) VIRTUAL")
        db.commit()
        db.close()
        return path.read_bytes()


def shared_probe_stacks(n: int) -> dict[str, Any]:
    """`n` distinct stacks of the same length whose first, middle and last frames are the same objects (the
    interner's probe), each allocated once."""
    rec = Recording()
    first, middle, last = ({"filename": f"/{w}.py", "line": 1, "name": w} for w in ("first", "middle", "last"))
    for i in range(n):
        rec.alloc(512)
        rec.entries[-1]["frames"] = [first, {"filename": "/a.py", "line": i, "name": "f"}, middle,
                                     {"filename": "/b.py", "line": i, "name": "g"}, last]
    return rec.snapshot()


def huge_names(chars: int, frames: int = 40, allocations: int = 30) -> dict[str, Any]:
    """One string of `chars` characters as file and function name of `frames` frames in each of `allocations`."""
    name = "x" * chars
    stack = [{"filename": f"/{name}{i}.py", "line": i, "name": name} for i in range(frames)]
    rec = Recording()
    for _ in range(allocations):
        rec.alloc(MiB)
        rec.entries[-1]["frames"] = stack
    data = rec.snapshot()
    for segment in data["segments"]:
        for block in segment["blocks"]:
            if "frames" in block:
                block["frames"] = stack
    return data


def with_controls(text: str) -> dict[str, Any]:
    """A snapshot that carries `text` in a frame's file and function, a module annotation and an allocator
    setting's key: every place a string of the input reaches the terminal summary."""
    rec = Recording()
    with rec.step(1), rec.phase("forward"), rec.range(f"nn.Module: {text}"):
        rec.alloc(4 * MiB, where=f"/home/{text}.py:3", name=text)
    data = rec.snapshot()
    data["allocator_settings"][text] = 1
    return data
