"""Write the hostile-input corpus: `python tests/hostile/make_corpus.py` (re)creates tests/hostile/corpus/.

Every file is built here from code, so the corpus can be reviewed and regenerated. corpus/MANIFEST.json says,
per file, its family, what it tries, and what the analyzer must answer: the AnalyzerError class it raises
(exit code 2, one line), "error" (any AnalyzerError: SQLite decides how a damaged page surfaces), or "ok"
(a complete analysis, whose warnings contain `warning` when given). Payloads marked `creates` would make that
directory in the current folder if loaded with plain `pickle.load`; tests/hostile/test_corpus.py proves that
they do, and that the analyzer makes nothing.

Families: pickle_code (each opcode that can import or call, alone, nested in a snapshot, gzipped),
pickle_corrupt, snapshot_fields (wrong types, bad values, billion laughs, deep nesting), chrome_trace,
memory_timeline, compressed (bombs and damaged gzip), sqlite (corrupt, truncated, other schemas, hostile
values and views), misc.
"""
from __future__ import annotations

import copyreg
import gzip
import json
import pickle
import shutil
import sqlite3
import struct
import sys
import tempfile
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
CORPUS = HERE / "corpus"
ROOT = HERE.parents[1]
NSYS_FIXTURE = ROOT / "fixtures" / "traces" / "nsys" / "oom_with_nccl.sqlite"

#: extension codes the EXT payloads use (tests register them, as an imported library might, to prove that
#: even a registered code is refused); one function per code, as copyreg requires, each making a directory
EXTENSIONS = {0xF0: ("os", "mkdir"), 0x1F0: ("os", "makedirs"), 0x1F0F0: ("posix", "mkdir")}
MEMO_BASE = 10_000         # memo indices of spliced opcodes, clear of those pickle.dumps used
BOMB_BYTES = 66 << 20      # just past analyzer.ingest.sniff.RATIO_FLOOR_BYTES
DEEP = 100_000             # nesting depth of the deep cases
LAUGHS = 40                # levels of the billion laughs: 2**40 leaves, a few hundred bytes pickled


@dataclass(frozen=True)
class Case:
    name: str
    family: str
    tries: str
    expect: str                  # an AnalyzerError subclass name, "error", or "ok"
    data: bytes
    warning: str | None = None   # for "ok": words one of the analysis warnings must contain
    creates: str | None = None   # for code payloads: what plain pickle.load would create in the current folder


# ---- building blocks ---------------------------------------------------------------------------------------
def tiny_snapshot() -> dict:
    """A small, consistent snapshot in the torch 2.13 layout: one segment, three allocations (one alive at the
    end), an annotation range and allocator settings."""
    frames = [{"filename": "/home/u/train.py", "line": 12, "name": "forward"},
              {"filename": "/home/u/train.py", "line": 40, "name": "main"}]
    base, mib = 0x7F0000000000, 1 << 20

    def entry(action: str, addr: int, size: int, t: int) -> dict:
        return {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": t, "frames": frames,
                "compile_context": "N/A", "user_metadata": ""}

    trace = [entry("segment_alloc", base, 2 * mib, 1), entry("alloc", base, 1000, 2),
             entry("alloc", base + 1024, 3000, 3), entry("alloc", base + 4096, 4096, 4),
             entry("free_requested", base, 1000, 5), entry("free_completed", base, 1000, 5),
             entry("free_requested", base + 1024, 3000, 6), entry("free_completed", base + 1024, 3000, 6)]
    blocks = [{"address": base, "size": 4096, "requested_size": 0, "state": "inactive", "frames": []},
              {"address": base + 4096, "size": 4096, "requested_size": 4096, "state": "active_allocated",
               "frames": frames},
              {"address": base + 8192, "size": 2 * mib - 8192, "requested_size": 0, "state": "inactive", "frames": []}]
    return {
        "segments": [{"device": 0, "address": base, "total_size": 2 * mib, "allocated_size": 4096,
                      "active_size": 4096, "requested_size": 4096, "stream": 0, "segment_type": "small",
                      "segment_pool_id": (0, 0), "is_expandable": False, "frames": frames, "blocks": blocks}],
        "device_traces": [trace],
        "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": "", "expandable_segments": False,
                               "roundup_power2_divisions": {str(1 << i): 0 for i in range(16)}},
        "external_annotations": [{"device": 0, "name": "ProfilerStep#1", "stage": "START", "time_us": 1},
                                 {"device": 0, "name": "ProfilerStep#1", "stage": "END", "time_us": 7}],
    }


def dumps(obj: object) -> bytes:
    return pickle.dumps(obj, protocol=4)


def spliced(obj: dict, placeholder: str, opcodes: bytes) -> bytes:
    """`obj` pickled (protocol 2: no frames, so bytes can be replaced) with the string `placeholder` replaced
    by `opcodes`, which must leave exactly one object on the stack."""
    data = pickle.dumps(obj, protocol=2)
    encoded = placeholder.encode()
    string = b"X" + struct.pack("<I", len(encoded)) + encoded
    assert data.count(string) == 1, placeholder
    return data.replace(string, opcodes)


def with_placeholder(path: tuple, placeholder: str = "PLACEHOLDER") -> dict:
    """tiny_snapshot() with the value at `path` (keys and indices) set to `placeholder`."""
    snapshot = tiny_snapshot()
    target = snapshot
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = placeholder
    return snapshot


def body(payload: bytes) -> bytes:
    """A payload's opcodes without its protocol header and final STOP, to embed in another pickle."""
    start = 2 if payload[:1] == b"\x80" else 0
    assert payload.endswith(b".")
    return payload[start:-1]


def unicode(text: str) -> bytes:
    """SHORT_BINUNICODE (protocol 4)."""
    encoded = text.encode()
    return b"\x8c" + bytes([len(encoded)]) + encoded


def binunicode(text: str) -> bytes:
    """BINUNICODE (protocol 1+)."""
    encoded = text.encode()
    return b"X" + struct.pack("<I", len(encoded)) + encoded


def deep_lists(depth: int) -> bytes:
    """Opcodes for `depth` lists, each inside the previous one (the C unpickler builds them without recursing)."""
    return b"]" * depth + b"a" * (depth - 1)


def shared_lists(levels: int) -> bytes:
    """Opcodes for a billion laughs: level k is (level k-1, level k-1) through the memo; str() of the result
    would print 2**levels leaves, and hashing it would take as long."""
    def put(k: int) -> bytes:
        return b"r" + struct.pack("<I", MEMO_BASE + k) + b"0"  # LONG_BINPUT, POP

    def get(k: int) -> bytes:
        return b"j" + struct.pack("<I", MEMO_BASE + k)

    ops = b"]" + binunicode("lol") + b"a" + put(0)
    for k in range(levels):
        ops += get(k) + get(k) + b"\x86" + put(k + 1)
    return ops + get(levels)


def gz(data: bytes) -> bytes:
    return gzip.compress(data, compresslevel=9, mtime=0)


def gz_stream(head: bytes, filler: bytes, size: int, tail: bytes) -> bytes:
    """gzip of head + filler * size + tail, compressed a chunk at a time (a bomb never exists uncompressed)."""
    compressor = zlib.compressobj(9, zlib.DEFLATED, 31)
    chunk = filler * (1 << 20)
    parts = [compressor.compress(head)]
    parts += [compressor.compress(chunk) for _ in range(size >> 20)]
    parts += [compressor.compress(tail), compressor.flush()]
    return b"".join(parts)


# ---- pickles that would run code ---------------------------------------------------------------------------
def code_payloads() -> dict[str, tuple[bytes, str]]:
    """name -> (pickle, what it tries): each, loaded with plain pickle, makes the directory `pwned_<name>`."""
    def m(name: str) -> str:
        return f"pwned_{name}"

    def setstate_trick(name: str, make_instance: bytes) -> bytes:
        # BUILD with a dict sets instance attributes; a second BUILD then calls the instance's __setstate__
        return (make_instance + b"}" + binunicode("__setstate__") + b"cos\nmkdir\nsb" + binunicode(m(name)) + b"b.")

    return {
        "global_reduce": (b"cos\nmkdir\n(S'" + m("global_reduce").encode() + b"'\ntR.",
                          "GLOBAL os.mkdir, then REDUCE calls it"),
        "stack_global_reduce": (b"\x80\x04" + unicode("os") + unicode("mkdir") + b"\x93" + unicode(m("stack_global_reduce"))
                                + b"\x85R.", "STACK_GLOBAL (protocol 4) os.mkdir, then REDUCE"),
        "inst": (b"(S'" + m("inst").encode() + b"'\nios\nmkdir\n.", "INST: import os.mkdir and call it"),
        "obj": (b"(cos\nmkdir\nS'" + m("obj").encode() + b"'\no.", "OBJ: call the class on the stack"),
        "newobj_build": (b"\x80\x02" + setstate_trick("newobj_build", b"cargparse\nNamespace\n)\x81"),
                         "NEWOBJ makes an object, BUILD plants __setstate__ = os.mkdir, a second BUILD calls it"),
        "newobj_ex_build": (b"\x80\x04" + setstate_trick("newobj_ex_build", unicode("argparse") + unicode("Namespace")
                                                          + b"\x93)}\x92"),
                            "NEWOBJ_EX (protocol 4) then the BUILD __setstate__ trick"),
        "reduce_build": (b"\x80\x02" + setstate_trick("reduce_build", b"cargparse\nNamespace\n)R"),
                         "REDUCE makes an object, then the BUILD __setstate__ trick"),
        "ext1": (b"\x80\x02\x82\xf0" + binunicode(m("ext1")) + b"\x85R.", "EXT1: a registered extension code names os.mkdir"),
        "ext2": (b"\x80\x02\x83" + struct.pack("<H", 0x1F0) + binunicode(m("ext2")) + b"\x85R.", "EXT2, the same"),
        "ext4": (b"\x80\x02\x84" + struct.pack("<I", 0x1F0F0) + binunicode(m("ext4")) + b"\x85R.", "EXT4, the same"),
        "nested_in_frames": (spliced(with_placeholder(("device_traces", 0, 1, "frames")), "PLACEHOLDER",
                                     b"cos\nmkdir\n(" + binunicode(m("nested_in_frames")) + b"tR"),
                             "GLOBAL+REDUCE deep inside a valid snapshot (the frames of a trace entry)"),
        "nested_in_settings": (spliced(with_placeholder(("allocator_settings", "PYTORCH_CUDA_ALLOC_CONF")),
                                       "PLACEHOLDER", b"(" + binunicode(m("nested_in_settings")) + b"ios\nmkdir\n"),
                               "INST inside the allocator settings of a valid snapshot"),
    }


def pickle_code_cases() -> list[Case]:
    cases = [Case(f"code_{name}.pickle", "pickle_code", tries, "UnsafePickle", data, creates=f"pwned_{name}")
             for name, (data, tries) in code_payloads().items()]
    payloads = code_payloads()
    cases.append(Case("code_stack_global_reduce.pickle.gz", "pickle_code", "the STACK_GLOBAL payload, gzipped",
                      "UnsafePickle", gz(payloads["stack_global_reduce"][0]), creates="pwned_stack_global_reduce"))
    cases.append(Case("code_nested_in_frames.pickle.gz", "pickle_code", "the nested GLOBAL payload, gzipped",
                      "UnsafePickle", gz(payloads["nested_in_frames"][0]), creates="pwned_nested_in_frames"))
    cases.append(Case("code_binpersid.pickle", "pickle_code", "BINPERSID: a persistent id (torch.load's hook)",
                      "UnsafePickle", b"\x80\x02" + binunicode("storage") + b"Q."))
    return cases


def pickle_corrupt_cases() -> list[Case]:
    def c(name: str, tries: str, expect: str, data: bytes) -> Case:
        return Case(f"pickle_{name}.pickle", "pickle_corrupt", tries, expect, data)

    return [
        c("reduce_without_global", "REDUCE on a string (nothing to call)", "CorruptInput", b"S'x'\n(tR."),
        c("build_on_dict", "BUILD on a dict (no __dict__)", "CorruptInput", b"\x80\x02}}b."),
        c("unregistered_ext", "EXT1 with a code nobody registered", "CorruptInput", b"\x80\x02\x82\x07."),
        c("out_of_band_buffer", "NEXT_BUFFER (protocol 5) without buffers", "CorruptInput", b"\x80\x05\x97."),
        c("lying_length", "BINBYTES8 that claims 2**62 bytes", "ResourceLimit",
          b"\x80\x04\x8e" + struct.pack("<Q", 2**62) + b"abc."),
        c("missing_memo", "BINGET of a memo entry never stored", "CorruptInput", b"\x80\x02h\x05."),
        c("huge_int_text", "INT with 10000 digits", "CorruptInput", b"I" + b"9" * 10_000 + b"\n."),
        c("stack_underflow", "STOP on an empty stack", "CorruptInput", b"\x80\x02."),
        c("truncated", "a snapshot cut in half", "CorruptInput", dumps(tiny_snapshot())[:700]),
    ] + [Case("pickle_deep_lists.pickle.gz", "pickle_corrupt", f"{DEEP} nested lists as the whole pickle (gzipped)",
              "CorruptInput", gz(b"\x80\x02" + deep_lists(DEEP) + b"."))]


# ---- snapshots with wrong fields ---------------------------------------------------------------------------
def mutated(edit) -> bytes:
    snapshot = tiny_snapshot()
    edit(snapshot)
    return dumps(snapshot)


def _entry(s: dict, i: int) -> dict:
    return s["device_traces"][0][i]


def snapshot_field_cases() -> list[Case]:
    def c(name: str, tries: str, expect: str, data: bytes, warning: str | None = None) -> Case:
        return Case(f"snapshot_{name}.pickle", "snapshot_fields", tries, expect, data, warning)

    laughs_frames = with_placeholder(("device_traces", 0, 1, "frames", 0, "filename"))
    laughs_settings = with_placeholder(("allocator_settings", "PYTORCH_CUDA_ALLOC_CONF"))
    deep_frames = with_placeholder(("device_traces", 0, 2, "frames", 0, "name"))
    return [
        c("size_as_string", "an entry size as a string", "CorruptInput",
          mutated(lambda s: _entry(s, 1).update(size="1000"))),
        c("negative_size", "a negative entry size", "CorruptInput", mutated(lambda s: _entry(s, 1).update(size=-1000))),
        c("negative_free_size", "a negative size on a free", "CorruptInput",
          mutated(lambda s: _entry(s, 4).update(size=-1000))),
        c("negative_block_size", "a negative block size", "CorruptInput",
          mutated(lambda s: s["segments"][0]["blocks"][0].update(size=-4096))),
        c("negative_segment_size", "a negative segment total_size", "CorruptInput",
          mutated(lambda s: s["segments"][0].update(total_size=-1))),
        c("size_beyond_2_64", "an entry size of 2**64 + 1", "CorruptInput",
          mutated(lambda s: _entry(s, 1).update(size=2**64 + 1))),
        c("sizes_overflow_int64", "two live sizes of 2**62 (their sum wraps int64)", "CorruptInput",
          mutated(lambda s: [_entry(s, i).update(size=2**62) for i in (1, 3)])),
        c("address_beyond_2_64", "a segment address past 2**64", "CorruptInput",
          mutated(lambda s: s["segments"][0].update(address=2**64 + 7))),
        c("nan_time", "time_us = NaN", "CorruptInput", mutated(lambda s: _entry(s, 2).update(time_us=float("nan")))),
        c("missing_action", "a trace entry without an action", "CorruptInput",
          mutated(lambda s: _entry(s, 1).pop("action"))),
        c("missing_size", "a trace entry without a size", "CorruptInput", mutated(lambda s: _entry(s, 1).pop("size"))),
        c("missing_segments", "a dict without 'segments'", "CorruptInput", mutated(lambda s: s.pop("segments"))),
        c("segments_not_list", "'segments' as a dict", "CorruptInput", mutated(lambda s: s.update(segments={}))),
        c("entry_not_dict", "a trace entry that is a list", "CorruptInput",
          mutated(lambda s: s["device_traces"][0].insert(1, [1, 2]))),
        c("action_not_string", "an action that is a tuple", "CorruptInput",
          mutated(lambda s: _entry(s, 1).update(action=("alloc",)))),
        c("state_not_string", "a block state that is an int", "CorruptInput",
          mutated(lambda s: s["segments"][0]["blocks"][1].update(state=1))),
        c("frame_filename_list", "a frame filename that is a list", "CorruptInput",
          mutated(lambda s: _entry(s, 1).update(frames=[{"filename": ["a"], "line": 1, "name": "f"}]))),
        c("billion_laughs_in_frame", f"a frame filename of 2**{LAUGHS} shared leaves", "CorruptInput",
          spliced(laughs_frames, "PLACEHOLDER", shared_lists(LAUGHS))),
        c("billion_laughs_in_settings", f"an allocator setting of 2**{LAUGHS} shared leaves", "ok",
          spliced(laughs_settings, "PLACEHOLDER", shared_lists(LAUGHS)), warning="allocator_settings"),
        Case("snapshot_deep_lists_in_frame.pickle.gz", "snapshot_fields", f"a frame name of {DEEP} nested lists",
             "CorruptInput", gz(spliced(deep_frames, "PLACEHOLDER", deep_lists(DEEP)))),
        c("settings_odd_values", "allocator settings with a tuple key, a set, bytes and a 10**30", "ok",
          mutated(lambda s: s["allocator_settings"].update({(1, 2): 3, "a": {1, 2}, "b": b"\xff", "c": 10**30})),
          warning="allocator_settings"),
        c("duplicated_alloc", "an address allocated twice without a free", "ok",
          mutated(lambda s: s["device_traces"][0].insert(2, dict(_entry(s, 1)))), warning="allocated twice"),
        c("free_before_alloc", "a free of a block never allocated", "ok",
          mutated(lambda s: s["device_traces"][0].insert(1, {**_entry(s, 3), "action": "free_requested",
                                                              "addr": 0x7F0000100000})), warning="already allocated before the first recorded event"),
        c("unknown_action", "an action torch never writes", "ok",
          mutated(lambda s: _entry(s, 1).update(action="<b>explode</b>")), warning="unknown actions"),
        c("frames_name_devices", "frames naming /dev/zero, /dev/stdin and a directory as source files", "ok",
          mutated(lambda s: [_entry(s, i).update(frames=[{"filename": f, "line": 1, "name": "forward"}])
                             for i, f in ((1, "/dev/zero"), (2, "/dev/stdin"), (3, "/"))])),
        c("empty_history", "no segments and no trace at all", "ok", dumps({"segments": [], "device_traces": [[]]}),
          warning="no allocations"),
        c("many_devices", "2000 devices of one entry each (minutes of per-device work)", "ResourceLimit",
          mutated(lambda s: s.update(device_traces=[[_entry(s, 1)] for _ in range(2000)]))),
    ]


# ---- Chrome traces and memory timelines --------------------------------------------------------------------
def chrome_trace() -> dict:
    """A small Kineto trace: three [memory] events, a step and a Python call."""
    def memory(ts: float, nbytes: int, addr: int, allocated: int) -> dict:
        return {"ph": "i", "cat": "cpu_instant_event", "s": "t", "name": "[memory]", "pid": 1, "tid": 1, "ts": ts,
                "args": {"Total Reserved": 2 << 20, "Total Allocated": allocated, "Bytes": nbytes, "Device Id": 0,
                         "Device Type": 1, "Addr": addr}}

    return {"schemaVersion": 1, "deviceProperties": [{"id": 0, "name": "GPU", "totalGlobalMem": 80 << 30}],
            "traceEvents": [
                {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "pid": 1, "tid": 1, "ts": 5.0,
                 "dur": 20.0, "args": {"External id": 1}},
                {"ph": "X", "cat": "python_function", "name": "train.py(12): forward", "pid": 1, "tid": 1, "ts": 9.0,
                 "dur": 5.0, "args": {"Python id": 1, "Python parent id": None}},
                memory(10.0, 1024, 4096, 1024), memory(11.0, 2048, 8192, 3072), memory(12.0, -1024, 4096, 2048)],
            "baseTimeNanoseconds": 1_700_000_000_000_000_000}


def chrome_bytes(edit=None) -> bytes:
    trace = chrome_trace()
    if edit:
        edit(trace)
    return json.dumps(trace).encode()


def chrome_cases() -> list[Case]:
    def c(name: str, tries: str, expect: str, data: bytes, warning: str | None = None) -> Case:
        return Case(f"chrome_{name}.json", "chrome_trace", tries, expect, data, warning)

    good = chrome_bytes()
    nested = b"[" * DEEP + b"]" * DEEP
    return [
        c("broken_utf8", "invalid UTF-8 in an event name", "CorruptInput",
          good.replace(b"ProfilerStep#1", b"Profiler\xff\xfeStep#1")),
        c("broken_utf8_metadata", "invalid UTF-8 in deviceProperties", "CorruptInput", good.replace(b'"GPU"', b'"G\xc3"')),
        c("control_characters", "raw control characters inside a string", "CorruptInput",
          good.replace(b"ProfilerStep#1", b"Profiler\x01\x1b[31mStep#1")),
        c("escaped_control_characters", "\\u0000 and an ANSI escape, correctly escaped, in names", "ok",
          good.replace(b"train.py(12): forward", b"tr\\u0000ain\\u001b[31m.py(12): forward")),
        c("int_beyond_int64", "Bytes = 10**26", "CorruptInput", good.replace(b'"Bytes": 2048', b'"Bytes": ' + b"9" * 26)),
        c("int_beyond_int64_metadata", "baseTimeNanoseconds = 10**30", "CorruptInput",
          good.replace(b"1700000000000000000", b"1" + b"0" * 30)),
        c("nan_literal", "ts = NaN (not JSON)", "CorruptInput", good.replace(b'"ts": 11.0', b'"ts": NaN')),
        c("time_1e308", "ts = 1e308 (finite, but no int64 time)", "CorruptInput", good.replace(b'"ts": 11.0', b'"ts": 1e308')),
        c("unterminated_array", "traceEvents never closed", "CorruptInput", good.split(b'], "baseTime')[0]),
        c("unterminated_string", "the file ends inside a string", "CorruptInput", good[: good.index(b"ProfilerStep") + 5]),
        c("negative_total_reserved", "Total Reserved < 0", "CorruptInput",
          chrome_bytes(lambda t: [e["args"].update({"Total Reserved": -1}) for e in t["traceEvents"][2:]])),
        c("wrong_types", "Bytes as a string", "CorruptInput",
          chrome_bytes(lambda t: t["traceEvents"][2]["args"].update(Bytes="1024"))),
        Case("chrome_deep_nesting_in_event.json.gz", "chrome_trace", f"{DEEP} nested arrays inside an event",
             "ResourceLimit", gz(good.replace(b'"args": {"External id": 1}', b'"args": ' + nested))),
        Case("chrome_deep_nesting_in_metadata.json.gz", "chrome_trace", f"{DEEP} nested arrays in deviceProperties",
             "ResourceLimit", gz(good.replace(b'[{"id": 0, "name": "GPU", "totalGlobalMem": 85899345920}]', nested))),
        c("byte_order_mark", "a UTF-8 BOM before the object", "UnsupportedFormat", b"\xef\xbb\xbf" + good),
        c("no_trace_events", "an object without traceEvents", "CorruptInput", b'{"schemaVersion": 1}'),
        c("trace_events_not_list", "traceEvents as a number", "ok", b'{"traceEvents": 5}', warning="no [memory] events"),
        Case("chrome_many_devices.json.gz", "chrome_trace", "[memory] events on 2000 devices (gzipped)", "ResourceLimit",
             gz(chrome_bytes(lambda t: t["traceEvents"].extend(
                 {**t["traceEvents"][2], "args": {**t["traceEvents"][2]["args"], "Device Id": d}}
                 for d in range(1, 2000))))),
    ]


def memory_timeline_cases() -> list[Case]:
    def c(name: str, tries: str, expect: str, rows: object) -> Case:
        data = rows if isinstance(rows, bytes) else json.dumps(rows).encode()
        return Case(f"timeline_{name}.json", "memory_timeline", tries, expect, data)

    zeros = [0] * 9
    return [
        c("raw_unknown_action", "a raw row with action 7", "CorruptInput", [[0, 7, 5, 0]]),
        c("raw_category_out_of_range", "a raw row with category 99", "CorruptInput", [[0, 2, 5, 99]]),
        c("raw_short_row", "a raw row of two numbers", "CorruptInput", [[-1, 1]]),
        c("curve_negative", "a curve with a negative category size", "CorruptInput",
          [[1, 2], [zeros, [0, -5, 0, 0, 0, 0, 0, 0, 0]]]),
        c("curve_overflow", "a curve whose categories add up past int64", "CorruptInput",
          [[1, 2], [zeros, [0, 2**62, 2**62, 0, 0, 0, 0, 0, 0]]]),
    ] + [Case("timeline_deep_nesting.json.gz", "memory_timeline", f"{DEEP} nested arrays", "ResourceLimit",
              gz(b"[" * DEEP + b"]" * DEEP))]


# ---- compressed --------------------------------------------------------------------------------------------
def compressed_cases() -> list[Case]:
    snapshot = gz(dumps(tiny_snapshot()))
    damaged = bytearray(snapshot)
    damaged[-8] ^= 0xFF  # the CRC
    return [
        Case("bomb_chrome.json.gz", "compressed", f"{BOMB_BYTES >> 20} MiB of blanks inside traceEvents",
             "ResourceLimit", gz_stream(b'{"traceEvents": [', b" ", BOMB_BYTES, b"]}")),
        Case("bomb_pickle.pickle.gz", "compressed", "BINBYTES8 of 256 MiB filled from a gzip bomb",
             "ResourceLimit", gz_stream(b"\x80\x04\x8e" + struct.pack("<Q", 256 << 20), b"\0", BOMB_BYTES, b".")),
        Case("bomb_zeros.gz", "compressed", "16 MiB of zeros: no format at all", "UnsupportedFormat",
             gz_stream(b"", b"\0", 16 << 20, b"")),
        Case("gzip_truncated.pickle.gz", "compressed", "a gzipped snapshot cut short", "CorruptInput",
             snapshot[: len(snapshot) // 2]),
        Case("gzip_bad_crc.pickle.gz", "compressed", "a gzipped snapshot with a wrong CRC", "CorruptInput",
             bytes(damaged)),
    ]


# ---- SQLite ------------------------------------------------------------------------------------------------
def sqlite_bytes(build) -> bytes:
    """A database written by `build(connection)` in a temporary file."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "db.sqlite"
        db = sqlite3.connect(path)
        build(db)
        db.commit()
        db.close()
        return path.read_bytes()


def nsys_variant(*statements: str | tuple) -> bytes:
    """The nsys fixture with every table rebuilt without constraints (a hostile file has none), then edited."""
    def build(db: sqlite3.Connection) -> None:
        source = sqlite3.connect(NSYS_FIXTURE)
        source.backup(db)
        source.close()
        for (table,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'").fetchall():
            db.executescript(f'CREATE TABLE "copy" AS SELECT * FROM "{table}"; DROP TABLE "{table}"; '
                             f'ALTER TABLE "copy" RENAME TO "{table}";')
        for statement in statements:
            db.execute(*statement) if isinstance(statement, tuple) else db.executescript(statement)
        db.commit()
        db.execute("VACUUM")
    return sqlite_bytes(build)


def sqlite_cases() -> list[Case]:
    fixture = NSYS_FIXTURE.read_bytes()
    damaged = bytearray(fixture)
    damaged[4096:6144] = b"\xff" * 2048  # pages 5 and 6 (of 1 KiB): b-tree pages overwritten
    endless = ("DROP TABLE NVTX_EVENTS; CREATE VIEW NVTX_EVENTS AS WITH RECURSIVE n(x) AS (SELECT 1 UNION ALL "
               "SELECT x + 1 FROM n) SELECT x AS start, x AS \"end\", 59 AS eventType, 'loop' AS text, "
               "0 AS globalTid, NULL AS textId, NULL AS domainId FROM n")
    deep_marker = '{"op": ' + "[" * 5000 + "]" * 5000 + ', "x": true}'  # past Python's recursion limit

    def c(name: str, tries: str, expect: str, data: bytes, warning: str | None = None) -> Case:
        return Case(f"sqlite_{name}.sqlite", "sqlite", tries, expect, data, warning)

    return [
        c("damaged_pages", "two b-tree pages overwritten with 0xFF", "error", bytes(damaged)),
        c("truncated", "the export cut in half", "error", fixture[: len(fixture) // 2]),
        c("header_only", "only the 100-byte SQLite header", "error", fixture[:100]),
        c("other_schema", "a database of another program", "UnsupportedFormat",
          sqlite_bytes(lambda db: db.executescript("CREATE TABLE users (id INTEGER, name TEXT); "
                                                   "INSERT INTO users VALUES (1, 'a');"))),
        c("string_ids_only", "StringIds and nothing an export has", "UnsupportedFormat",
          sqlite_bytes(lambda db: db.executescript("CREATE TABLE StringIds (id INTEGER, value TEXT);"))),
        c("text_in_numbers", "text where the schema has memory sizes", "CorruptInput",
          nsys_variant("UPDATE CUDA_GPU_MEMORY_USAGE_EVENTS SET bytes = 'lots'")),
        c("null_device", "NULL device ids", "CorruptInput",
          nsys_variant("UPDATE CUDA_GPU_MEMORY_USAGE_EVENTS SET deviceId = NULL")),
        c("real_sizes_beyond_int64", "sizes stored as REAL 1e30", "CorruptInput",
          nsys_variant("UPDATE CUDA_GPU_MEMORY_USAGE_EVENTS SET bytes = 1e30")),
        c("endless_view", "NVTX_EVENTS as an endless recursive view", "ok", nsys_variant(endless),
          warning="Nsight records cudaMalloc"),
        c("nvtx_deep_marker", "an NVTX marker of 5000 nested arrays (json.loads recurses)", "ok",
          nsys_variant(("UPDATE NVTX_EVENTS SET text = ? WHERE rowid = 3", (deep_marker,))),
          warning="Nsight records cudaMalloc"),
    ]


def misc_cases() -> list[Case]:
    return [
        Case("empty.pickle", "misc", "an empty file", "CorruptInput", b""),
        Case("random_bytes.bin", "misc", "bytes of no format", "UnsupportedFormat", bytes(range(256)) * 4),
        Case("nsys_rep_magic.nsys-rep", "misc", "a binary Nsight report", "UnsupportedFormat",
             b"NVIDIA Tegra Profiler Report" + b"\0" * 64),
    ]


def cases() -> list[Case]:
    return [*pickle_code_cases(), *pickle_corrupt_cases(), *snapshot_field_cases(), *chrome_cases(),
            *memory_timeline_cases(), *compressed_cases(), *sqlite_cases(), *misc_cases()]


def register_extensions() -> None:
    """Register the EXT payloads' codes, as a library imported into the process might have."""
    for code, (module, name) in EXTENSIONS.items():
        copyreg.add_extension(module, name, code)  # a no-op when already registered


def manifest(all_cases: list[Case]) -> dict[str, dict]:
    return {c.name: {k: v for k, v in asdict(c).items() if k not in ("name", "data")} for c in all_cases}


def main() -> int:
    all_cases = cases()
    if CORPUS.exists():
        shutil.rmtree(CORPUS)
    CORPUS.mkdir()
    for case in all_cases:
        (CORPUS / case.name).write_bytes(case.data)
    (CORPUS / "MANIFEST.json").write_text(json.dumps(manifest(all_cases), indent=1, sort_keys=True) + "\n")
    size = sum(len(c.data) for c in all_cases)
    print(f"{len(all_cases)} files, {size / 1024:.0f} KiB, in {CORPUS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
