"""The log of runs (`analyze FILE --log runs.jsonl`): one JSON line per analysis, appended, read back line by line.

A line keeps what a later run is compared with: per device the memory the run needed and reserved, the
categories at the peak, the verdict, whether it ran out or fits, the remedies' predicted savings; and the
configuration the recording itself reveals (GPUs, precision regime, autocast, workload, steps recorded), never
a guess of what it does not show (the micro-batch is not recorded, so it is not logged). It is built from the
analyzer/1 JSON document, the contract that stays stable, so a log outlives versions of the analyzer.

One analysis is one `write` of one line to a file opened with O_APPEND: runs logging to the same file at once
never interleave (POSIX appends each write whole at the end). Reading skips a malformed line and says which.
"""
from __future__ import annotations

import errno
import json
import math
import os
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, BinaryIO

from analyzer import __version__
from analyzer.core.vocabulary import LAYOUT_ONLY_REMEDIES, RUN_LOG_ENV
from analyzer.errors import CorruptInput, InputNotFound, OutputError
from analyzer.report.job_report import JobReport, Report

SCHEMA = "analyzer-run-log/1"
#: bytes of one line of the log past which it is skipped unread (a run's line is a few KiB; a job of 512 ranks
#: some hundreds)
MAX_LINE_BYTES = 16 << 20
#: the configuration a recording reveals, compared between runs (analyzer.report.run_pairs)
CONFIG_VARIABLES = ("gpus", "precision", "autocast", "workload", "frozen_share")
_DEVICE_FIELDS = {"device": int, "needed_bytes": int, "peak_allocated_bytes": int, "peak_reserved_bytes": int,
                  "oom": bool, "remedies": list}


def document_of(report: Report) -> dict[str, Any]:
    """The analyzer/1 document of one recording or of a job of ranks."""
    return report.document if isinstance(report, JobReport) else report.to_json()


def log_line(document: dict[str, Any], note: str | None, now: datetime | None = None) -> dict[str, Any]:
    """The line logged for one analysis."""
    devices = [_device(d) for d in document["devices"]]
    source = document["source"]
    ranks = source.get("ranks") if source.get("kind") == "ranks" else None
    workloads = [d.get("workload") or {} for d in document["devices"]]
    config = {
        "gpus": _common(w.get("gpus") for w in workloads) or (len(ranks) if ranks else None),
        "ranks": ranks,
        "precision": _common((d.get("theory") or {}).get("regime") for d in document["devices"]),
        "autocast": _common(w.get("mixed_precision_on") for w in workloads),
        "workload": _common(w.get("kind") for w in workloads),
        "frozen_share": _common(None if w.get("frozen_share") is None else round(w["frozen_share"], 2)
                                for w in workloads),
        "devices": len(devices),
        "steps": _common(len(d.get("steps") or []) or None for d in document["devices"]),
    }
    return {"schema": SCHEMA, "time": (now or datetime.now(timezone.utc)).isoformat(timespec="seconds"),
            "analyzer": __version__, "input": source["path"], "input_kind": source.get("kind"), "note": note,
            "config": config, "devices": devices}


def _common(values: Iterator[Any]) -> Any:
    """The one value the devices that know it agree on; None when none knows it or they disagree."""
    known = {v for v in values if v is not None}
    return known.pop() if len(known) == 1 else None


def _device(d: dict[str, Any]) -> dict[str, Any]:
    fits = d.get("fits")
    plan = d.get("plan") or {}
    return {
        "device": d["device"], "rank": d.get("rank"), "capacity_bytes": d.get("capacity_bytes"),
        "needed_bytes": d.get("demand_bytes") or d["peak"]["allocated_bytes"],
        "peak_allocated_bytes": d["peak"]["allocated_bytes"], "peak_reserved_bytes": d["reserved_peak_bytes"],
        "by_category": d["peak"]["by_category"], "headline": d["peak"].get("summary"), "verdict": d.get("verdict"),
        "oom": d.get("oom") is not None, "fits": fits is not None,
        "capacity_assumed": bool(fits.get("capacity_assumed")) if fits else None,
        "remedies": [{"id": r["id"], "title": r["title"], "saved_bytes": r["saved_bytes"],
                      "new_peak_bytes": r.get("new_peak_bytes"), "fits": r.get("fits"),
                      "source": r.get("saving_source"),
                      "measure": "reserved" if r["id"] in LAYOUT_ONLY_REMEDIES else "needed"}
                     for r in d.get("remedies", []) if r.get("saved_bytes") is not None],
        "plan": [{"remedy": s.get("remedy"), "title": s.get("title"), "value": s.get("value"),
                  "predicted_peak_allocated_bytes": s.get("predicted_peak_allocated_bytes"), "fits": s.get("fits")}
                 for s in plan.get("steps", [])],
    }


@contextmanager
def appending(path: Path) -> Iterator[Callable[[dict[str, Any]], None]]:
    """Open the log before the analysis (a path that cannot be written fails at once, not after a long analysis);
    the function it yields appends one line with one write. A symbolic link at the log's path is never followed
    (a planted `runs.jsonl` -> `~/.bashrc` would get input strings appended), and only a regular file is
    appended to (a FIFO would block, a device is no log)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
    except OSError as error:
        raise _log_error(path, error) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OutputError(path, "is not a regular file; nothing was appended",
                          f"Pass --log a file in a folder you can write, or unset {RUN_LOG_ENV}.")

    def append(line: dict[str, Any]) -> None:
        data = (json.dumps(line, separators=(",", ":")) + "\n").encode("utf-8")
        try:
            written = os.write(fd, data)
        except OSError as error:
            raise _log_error(path, error) from None
        if written != len(data):
            raise OutputError(path, f"only {written} of the line's {len(data)} bytes were appended to the run log",
                              "Check the free space; the log's last line is cut and will be skipped when read.")

    try:
        yield append
    finally:
        os.close(fd)


def _log_error(path: Path, error: OSError) -> OutputError:
    if isinstance(error, IsADirectoryError):
        problem = "is a directory, not a run log"
    elif error.errno == errno.ELOOP:
        problem = "is a symbolic link; it was not followed and nothing was appended"
    elif error.errno == errno.ENXIO:
        problem = "is not a regular file (a FIFO nobody reads); nothing was appended"
    elif isinstance(error, (FileNotFoundError, NotADirectoryError)):
        problem = f"the folder {path.parent} does not exist"
    elif isinstance(error, PermissionError):
        problem = "the run log cannot be written (permission denied)"
    else:
        problem = f"the run log cannot be written ({error.strerror or error})"
    return OutputError(path, problem, f"Pass --log a file in a folder you can write, or unset {RUN_LOG_ENV}.")


@dataclass(frozen=True)
class Run:
    """One logged analysis and the line of the log it was read from (1-based)."""

    line: int
    record: dict[str, Any]

    @property
    def devices(self) -> list[dict[str, Any]]:
        devices: list[dict[str, Any]] = self.record["devices"]
        return devices

    @property
    def config(self) -> dict[str, Any]:
        config: dict[str, Any] = self.record.get("config") or {}
        return config

    @property
    def worst(self) -> dict[str, Any]:
        """The device that needed the most memory: the run's peak."""
        return max(self.devices, key=lambda d: d["needed_bytes"])


@dataclass(frozen=True)
class RunLog:
    runs: list[Run]
    skipped: list[str] = field(default_factory=list)   # 'line 3: not JSON (...)', one per malformed line


def read_log(path: Path) -> RunLog:
    """Every well-formed run of the log, in the order logged; a malformed line is skipped and named. A log
    without any run is one error. Only a regular file is read (`/dev/zero`, a FIFO never end), line by line, and a
    line longer than MAX_LINE_BYTES is skipped unread (a run's line is a few KiB)."""
    runs, skipped, lines = [], [], 0
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        with open(fd, "rb") as f:
            mode = os.fstat(fd).st_mode
            if stat.S_ISDIR(mode):
                raise IsADirectoryError
            if not stat.S_ISREG(mode):
                raise InputNotFound(path, "is not a regular file, not a run log", "Pass the .jsonl file `analyze "
                                    "FILE --log` appends to.")
            for lines, raw in enumerate(_lines(f), start=1):
                if raw is None:
                    skipped.append(f"line {lines}: longer than {MAX_LINE_BYTES} bytes")
                    continue
                if not raw.strip():
                    continue
                record, problem = _parse(raw)
                if record is not None:
                    runs.append(Run(lines, record))
                else:
                    skipped.append(f"line {lines}: {problem}")
    except IsADirectoryError:
        raise InputNotFound(path, "is a directory, not a run log", "Pass the .jsonl file `analyze FILE --log` "
                            "appends to.") from None
    except FileNotFoundError:
        raise InputNotFound(path, "no such run log", "Log runs first: analyze FILE --log PATH.") from None
    except OSError as error:
        raise InputNotFound(path, f"the run log cannot be read ({error.strerror or error})", "") from None
    if not runs:
        detail = f"; {skipped[0]}" if skipped else ""
        raise CorruptInput(path, f"holds no run the analyzer logged ({lines} line{'s' if lines != 1 else ''}, "
                           f"{len(skipped)} malformed{detail})", "Log runs with: analyze FILE --log PATH.")
    return RunLog(runs, skipped)


def _lines(f: BinaryIO) -> Iterator[bytes | None]:
    """The file's lines, None for one longer than MAX_LINE_BYTES (read past in chunks, never held)."""
    while True:
        raw = f.readline(MAX_LINE_BYTES + 1)
        if not raw:
            return
        if len(raw) <= MAX_LINE_BYTES or raw.endswith(b"\n"):
            yield raw
            continue
        while raw and not raw.endswith(b"\n"):
            raw = f.readline(1 << 20)
        yield None


def _parse(raw: bytes) -> tuple[dict[str, Any] | None, str | None]:
    """The run a line holds, or why it holds none."""
    try:
        record = json.loads(raw, parse_constant=_not_json, parse_int=_int64, parse_float=_finite)
    except (ValueError, RecursionError):
        return None, "not JSON (a cut or edited line)"
    except OverflowError:
        return None, "a number beyond 64 bits"
    problem = _problem(record)
    return (record, None) if problem is None else (None, problem)


def _not_json(constant: str) -> None:
    raise ValueError(f"{constant} is not JSON")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise OverflowError(text[:20])
    return value


def _int64(text: str) -> int:
    """A JSON integer, refused past int64 (every count and size the analyzer logs fits)."""
    if len(text) > 20 or not -(2**63) <= (value := int(text)) < 2**63:
        raise OverflowError(text[:20])
    return value


def _problem(record: Any) -> str | None:
    """Why a parsed line is not a run of this log, or None when it is one."""
    if not isinstance(record, dict) or record.get("schema") != SCHEMA:
        return f"not a record of {SCHEMA}"
    for name in ("time", "input"):
        if not isinstance(record.get(name), str):
            return f"no {name}"
    if record.get("note") is not None and not isinstance(record["note"], str):
        return "a note that is not text"
    if not isinstance(record.get("config", {}), dict):
        return "a config that is not an object"
    devices = record.get("devices")
    if not isinstance(devices, list) or not devices:
        return "no devices"
    for d in devices:
        if not isinstance(d, dict):
            return "a device that is not an object"
        for name, kind in _DEVICE_FIELDS.items():
            value = d.get(name)
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                return f"a device without {name}"
        if d.get("rank") is not None and (not isinstance(d["rank"], int) or isinstance(d["rank"], bool)):
            return "a device whose rank is not a number"
        if not all(isinstance(r, dict) and isinstance(r.get("id"), str) and isinstance(r.get("saved_bytes"), int)
                   and r.get("measure") in ("needed", "reserved") for r in d["remedies"]):
            return "a remedy without an id or a saving"
    return None
