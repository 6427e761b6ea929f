"""The analysis of a text log: per OOM its numbers, cause, phase and remedies; what the repeated memory lines
show; and what to record next. A log holds moments, not a history, so this is its own result type with its own
renderers (analyzer.report.log_*), not an `Analysis`: `capabilities` says what a log cannot tell.

`to_json()` writes the analyzer/1 contract's common keys (`schema`, `source`, `warnings`, `devices`, which
is empty: no device was recorded) and the log's own: `ooms`, `findings`, `gpu_peaks`, `readings`, `verdict`,
`gpu_processes`, `memory_highs`, `record_next`. Every size is bytes.
"""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from analyzer.core.log_records import GpuPeak, GpuProcess, LogFinding, LogReading, LogRemedy, MemoryHigh, OomText
from analyzer.core.vocabulary import SCHEMA, phase_in_sentence
from analyzer.errors import UnsupportedFormat
from analyzer.ingest.log import read_log_file
from analyzer.ingest.log.traceback import INFERENCE, phase_of, user_frame
from analyzer.ingest.sniff import ACCEPTED, looks_like, open_input
from analyzer.log_diagnose import advice, trends
from analyzer.log_diagnose.cause import UNKNOWN, Cause, judge

#: what a log cannot tell, for readers of the JSON (a recording's capabilities would be true)
CAPABILITIES = {"has_history": False, "has_stacks": False, "has_categories": False, "has_modules": False}


@dataclass(frozen=True)
class LogOom:
    """One OOM of the log, judged."""

    text: OomText
    cause: Cause
    phase: str | None
    user_frame: str | None
    remedies: list[LogRemedy]

    def to_json(self) -> dict[str, Any]:
        o, c = self.text, self.cause
        return {
            "line": o.line, "rank": o.rank, "device": o.device, "backend": o.backend, "era": o.era,
            "source": o.source, "cause": c.cause, "reason": c.reason, "phase": self.phase,
            "user_frame": self.user_frame, "repeats": o.repeats,
            "requested_bytes": o.requested_bytes, "capacity_bytes": o.capacity_bytes, "free_bytes": o.free_bytes,
            "allowed_bytes": o.allowed_bytes, "allocated_bytes": o.allocated_bytes, "reserved_bytes": o.reserved_bytes,
            "unallocated_bytes": o.unallocated_bytes, "this_process_bytes": o.this_process_bytes,
            "non_pytorch_bytes": c.non_pytorch_bytes, "private_pool_bytes": o.private_pool_bytes,
            "other_processes": [{"pid": p, "bytes": b} for p, b in c.other_processes],
            "outside_bytes": c.outside_bytes, "must_free_bytes": c.must_free_bytes, "limit": c.limit,
            "inconsistent": c.inconsistent, "notes": c.notes, "malloc_at": o.malloc_at,
            "frames": [{"file": f, "line": n, "function": fn} for f, n, fn, _ in o.frames],
            "remedies": self.remedies, "message": o.text,
        }

    def sentence(self) -> str:
        """'Out of memory on cuda:0 in the backward pass (train.py:42 in main): fragmentation: ...'."""
        device = f"{self.text.backend.lower()}:{self.text.device}" if self.text.device is not None else \
            f"the {self.text.backend} device"
        where = f" in {'inference' if self.phase == INFERENCE else phase_in_sentence(self.phase)}" if self.phase else ""
        frame = f" ({self.user_frame})" if self.user_frame else ""
        rank = f"rank {self.text.rank}, " if self.text.rank is not None else ""
        cause = "cause unknown" if self.cause.cause == UNKNOWN else self.cause.cause.replace("_", " ")
        first = f" Try first: {self.remedies[0]['title']}." if self.remedies else ""
        return f"Out of memory on {rank}{device}{where}{frame}: {cause}: {self.cause.reason}.{first}"


@dataclass(frozen=True)
class LogAnalysis:
    """A text log analysed."""

    reading: LogReading
    ooms: list[LogOom]
    findings: list[LogFinding]
    gpu_peaks: list[GpuPeak]
    gpu_processes: list[GpuProcess]
    memory_highs: list[MemoryHigh] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def verdict(self) -> str:
        """The last OOM's sentence (the one that ended the run), or what the log shows without one."""
        if self.ooms and self.findings and self.findings[0]["kind"] == "serving_startup":
            return self.ooms[-1].sentence() + " " + self.findings[0]["summary"] + "."
        if self.ooms:
            more = f" ({len(self.ooms)} OOMs in this log; the last is shown.)" if len(self.ooms) > 1 else ""
            return self.ooms[-1].sentence() + more
        if self.findings:
            return "No out-of-memory error in this log. " + "; ".join(f["summary"] for f in self.findings) + "."
        n = len(self.reading.readings)
        highest = f": {self.memory_highs[0]['summary']}" if len(self.memory_highs) == 1 else \
            f"; {len(self.memory_highs)} series of memory lines, each at its highest below" if self.memory_highs else ""
        return f"No out-of-memory error in this log; {n} memory reading{'s' if n != 1 else ''}, nothing out of line{highest}."

    def to_json(self) -> dict[str, Any]:
        r = self.reading
        return {
            "schema": SCHEMA,
            "source": {"path": r.path, "kind": "log", "lines": r.lines, "frameworks": r.frameworks, **CAPABILITIES},
            "allocator_settings": [{"line": s.line, "value": s.value} for s in r.settings],
            "warnings": list(self.warnings),
            "devices": [],
            "verdict": self.verdict,
            "ooms": [o.to_json() for o in self.ooms],
            "findings": self.findings,
            "gpu_peaks": self.gpu_peaks,
            "gpu_processes": self.gpu_processes,
            "memory_highs": self.memory_highs,
            "readings": {"count": len(r.readings), "by_source": dict(Counter(x.source for x in r.readings))},
            "record_next": advice.record_next(),
        }

    def to_json_text(self) -> str:
        return json.dumps(self.to_json(), indent=2)


LOOKED_FOR = ("an out-of-memory message (CUDA/HIP/XPU/MPS, CUBLAS_STATUS_ALLOC_FAILED, NCCL), a "
              "memory_summary() table or memory_stats() dict, nvidia-smi output, or Megatron/DeepSpeed/vLLM/SGLang "
              "memory lines")


def analyze_reading(reading: LogReading) -> LogAnalysis:
    """Judge every OOM of a reading and look across its memory lines."""
    processes = trends.gpu_processes(reading.readings)
    ooms = []
    for o in reading.ooms:
        cause = judge(o)
        ooms.append(LogOom(o, cause, phase_of(o.frames), user_frame(o.frames),
                           advice.remedies(o, cause, reading.settings, reading.frameworks, processes)))
    trend = trends.leaks(reading.readings)
    balance = trends.imbalance(reading.readings)
    findings = advice.serving_findings(reading.readings) + trend + ([balance] if balance else [])
    return LogAnalysis(reading, ooms, findings, trends.gpu_peaks(reading.readings), processes,
                       trends.memory_highs(reading.readings), list(reading.warnings))


def _looks(path: Path) -> str:
    """What the start of a text file looks like (CSV, text quoting its first line)."""
    with open_input(path) as stream:
        return looks_like(stream.read(4096)) or "text"


def analyze_log(path: str | Path) -> LogAnalysis:
    """Read and analyse a text log ("-": standard input); a text with none of what is looked for is bad input."""
    reading = read_log_file(path)
    if not reading.ooms and not reading.readings:
        looks = "the text" if str(path) == "-" else f"it looks like {_looks(Path(path))}"
        raise UnsupportedFormat(path if str(path) != "-" else None, f"{looks}, with no GPU memory information in it "
                                f"(looked for {LOOKED_FOR})", f"Pass the run's log or the pasted error. {ACCEPTED}")
    return analyze_reading(reading)
