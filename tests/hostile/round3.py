"""Generators of issue 37's hostile classes, each sized by a parameter: run logs (many runs, huge lines, numbers
and strings no analysis writes), snapshots carrying lone surrogates and invisible characters, archives whose
first header declares gigabytes, frame paths deep or spelled many ways, pickles of many small objects, and
folders of ranks full of empty files or junk members."""
from __future__ import annotations

import gzip
import io
import os
import pickle
import tarfile
from typing import Any

from analyzer.report.run_log import SCHEMA
from tests.hostile.round2 import small_snapshot
from tests.support.snapshots import MiB, Recording

#: characters that show nothing, or hide text: zero-width space, non-joiner, joiner, word joiner, U+FEFF, a soft
#: hyphen, Hangul fillers, the blank braille pattern, and Unicode tag characters spelling "hi"
INVISIBLE = ["\u200b", "\u200c", "\u200d", "\u2060", "\ufeff", "\u00ad", "\u115f", "\u3164", "\u2800",
             "\U000e0068\U000e0069"]
SURROGATE = "\udc80"


def run_record(i: int, note: str | None = None, gpus: int | None = 1, needed: int = 8 << 30) -> dict[str, Any]:
    """One well-formed line of the run log: one device offering micro_batch, configuration `gpus`."""
    return {"schema": SCHEMA, "time": f"2026-12-01T{i % 24:02d}:00:00+00:00", "analyzer": "0", "input": f"r{i}.pickle",
            "input_kind": "snapshot", "note": note,
            "config": {"gpus": gpus, "precision": "fp32", "autocast": False, "workload": "training",
                       "frozen_share": None, "devices": 1, "steps": 2},
            "devices": [{"device": 0, "rank": None, "capacity_bytes": 80 << 30, "needed_bytes": needed,
                         "peak_allocated_bytes": needed, "peak_reserved_bytes": needed, "by_category": {},
                         "headline": None, "verdict": None, "oom": False, "fits": True, "capacity_assumed": False,
                         "remedies": [{"id": "micro_batch", "title": "t", "saved_bytes": 1 << 30, "new_peak_bytes":
                                       None, "fits": None, "source": None, "measure": "needed"}], "plan": []}]}


def many_runs(n: int) -> bytes:
    """`n` runs whose notes all name micro_batch (each already after the change: no pair by note), with the same
    configuration (no pair by configuration): every earlier run is a candidate and none pairs."""
    import json

    return b"".join(json.dumps(run_record(i, note="micro_batch again")).encode() + b"\n" for i in range(n))


def snapshot_with(text: str) -> dict[str, Any]:
    """A snapshot carrying `text` in a frame's file and function, a module annotation, user metadata and an
    allocator setting's key and value."""
    rec = Recording()
    with rec.step(1), rec.phase("forward"), rec.range(f"nn.Module: {text}"):
        rec.alloc(4 * MiB, where=f"/home/{text}.py:3", name=text)
    data = rec.snapshot()
    data["device_traces"][0][-1]["user_metadata"] = text
    data["allocator_settings"][text] = text
    return data


def tar_with_huge_first_header(kind: bytes, declared: int, padding: int) -> bytes:
    """A .tar.gz whose first member is a GNU long-name ('L') or pax ('x') header declaring `declared` bytes of
    name or attributes, followed by `padding` zeros: tarfile reads the whole declared size to parse it."""
    header = tarfile.TarInfo("././@LongLink")
    header.type = kind
    header.size = declared
    block = header.tobuf(tarfile.GNU_FORMAT if kind == tarfile.GNUTYPE_LONGNAME else tarfile.USTAR_FORMAT)
    block = block[:512]
    out = io.BytesIO()
    with gzip.GzipFile(fileobj=out, mode="wb", compresslevel=9) as z:
        z.write(block)
        chunk = b"\0" * (1 << 20)
        for _ in range(padding // len(chunk)):
            z.write(chunk)
    return out.getvalue()


def deep_frames(depth: int, files: int = 4) -> dict[str, Any]:
    """A snapshot whose frames name files `depth` folders deep (`/a/a/.../a/mN.py`)."""
    rec = Recording()
    folder = "/" + "/".join(["a"] * depth)
    for i in range(files):
        rec.alloc(MiB, where=f"{folder}/m{i}.py:{i + 1}", name="forward")
    return rec.snapshot()


def respelled_frames(folder: str, spellings: int) -> dict[str, Any]:
    """A snapshot whose `forward` frames name one file, `folder/model.py`, in `spellings` ways
    (`folder/./model.py`, `folder/././model.py`, ...)."""
    rec = Recording()
    for i in range(spellings):
        rec.alloc(512, where=f"{folder}/{'./' * (i + 1)}model.py:3", name="forward")
    return rec.snapshot()


def junk_tar(members: int, trace: bytes) -> bytes:
    """A .tar.gz of `members` one-byte files that are no recording, then one profiler trace (`trace`, its bytes)."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz") as archive:
        for i in range(members):
            info = tarfile.TarInfo(f"junk{i}.txt")
            info.size = 1
            archive.addfile(info, io.BytesIO(b"x"))
        info = tarfile.TarInfo("rank0.pt.trace.json.gz")
        info.size = len(trace)
        archive.addfile(info, io.BytesIO(trace))
    return out.getvalue()


def shared_frame_stacks(stacks: int, frames: int) -> bytes:
    """A gzipped snapshot of `stacks` allocations, each with a distinct stack made of the same `frames` frame
    objects (rotations of one list): the pickle's memo makes each a few bytes a frame, gzip a few bytes a stack."""
    rec = Recording()
    shared = [{"filename": f"/src/m{i}.py", "line": i + 1, "name": f"f{i}"} for i in range(frames)]
    for i in range(stacks):
        rec.alloc(512)
        rec.entries[-1]["frames"] = shared[i % frames:] + shared[:i % frames] + shared[:i // frames]
    return gzip.compress(pickle.dumps(rec.snapshot(), protocol=4), 9)


def nones_behind_a_prefix(nones: int, prefix: int) -> bytes:
    """A gzipped snapshot whose allocator settings hold `prefix` random bytes, then whose user metadata is a list
    of `nones` Nones (one NONE opcode each, compressed about 1000 times): as a whole it expands less than the
    ratio limit, the list alone far more."""
    import zlib

    data = small_snapshot()
    data["allocator_settings"]["pad"] = os.urandom(prefix)
    data["device_traces"][0][0]["user_metadata"] = "__LIST__"
    body = pickle.dumps(data, protocol=3)   # bytes as BINBYTES, and no frames whose lengths the list would break
    head, tail = body.split(b"X\x08\x00\x00\x00__LIST__")   # BINUNICODE, its length, the text
    packer = zlib.compressobj(9, zlib.DEFLATED, 31)   # gzip framing
    out = [packer.compress(head + b"]("), *(packer.compress(b"N" * (1 << 20)) for _ in range(nones >> 20)),
           packer.compress(b"N" * (nones & ((1 << 20) - 1)) + b"e" + tail), packer.flush()]
    return b"".join(out)


def references(count: int, every: int = 1024) -> bytes:
    """A gzipped snapshot whose user metadata is a list of about `count` references: `None`s with a random small
    integer (a cached object too) after every `every`, so that the file expands 190 times, under the ratio limit
    of 200, while each pickle byte makes a reference (8 bytes of memory). One 1 MiB piece, compressed once, is
    repeated as gzip members (a gzip stream may hold several; they read as one)."""
    data = small_snapshot()
    data["device_traces"][0][0]["user_metadata"] = "__LIST__"
    head, tail = pickle.dumps(data, protocol=3).split(b"X\x08\x00\x00\x00__LIST__")
    piece = b"".join(b"N" * every + b"K" + bytes([b]) for b in os.urandom((1 << 20) // (every + 2)))
    member = gzip.compress(piece, 9)
    return b"".join([gzip.compress(head + b"]("), *[member] * -(-count // len(piece)), gzip.compress(b"e" + tail)])
