"""What a gate reads: anything `analyze` reads (analysed here), an earlier `analyze --format json` result, a
baseline file (analyzer.gate.summary), or the golden values of Megatron-LM's functional tests.

Megatron-LM's golden values (tests/functional_tests/test_cases/*/*/golden_values_*.json in NVIDIA/Megatron-LM)
map each metric to `{"start_step", "end_step", "step_interval", "values": {"<step>": value}}`, the shape of
`GoldenValueMetric` in tests/functional_tests/python_test_utils/common.py; a value the run did not log is the
string "nan". `mem-max-allocated-bytes` is `torch.cuda.memory_stats()["allocated_bytes.all.peak"]` logged at
each step under --log-memory-to-tensorboard (megatron/training/training.py): a running peak, so its largest
value is the run's peak. (Read at NVIDIA/Megatron-LM d98e8a64dd, e.g. gpt/gpt3_mcore_tp1_pp2/
golden_values_dev_dgx_h100.json.)

The kind is told from the first bytes, so a large profiler trace is never parsed twice: our JSON documents
begin with their schema, and a golden-values file's first metric with its `start_step`.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from analyzer.errors import CorruptInput, ResourceLimit, UnsupportedFormat
from analyzer.gate.summary import (
    BASELINE_PREFIX,
    DevicePeak,
    Kind,
    Option,
    RunPeaks,
    StepPeak,
    from_baseline,
    from_document,
)
from analyzer.ingest.sniff import KINETO, LOG, check_path, open_input, sniff

if TYPE_CHECKING:
    from analyzer.log_result import LogAnalysis

MEGATRON_METRIC = "mem-max-allocated-bytes"
MAX_DOCUMENT_BYTES = 256 << 20    # a JSON result or baseline larger than this is no summary
_HEAD = 4096
_ANALYSIS = re.compile(rb'^\s*\{\s*"schema"\s*:\s*"analyzer/1"')
_BASELINE = re.compile(rb'^\s*\{\s*"schema"\s*:\s*"' + re.escape(BASELINE_PREFIX.encode()))
_GOLDEN = re.compile(rb'^\s*\{\s*"(?:[^"\\]|\\.)*"\s*:\s*\{\s*"start_step"')


class NoGpuMemory(UnsupportedFormat):
    """The input holds no GPU that allocated anything: a gate must not pass on a recording that missed the run."""


def read_run(path: str | Path, gpu_memory: int | None = None) -> RunPeaks:
    """The peaks of whatever is at `path`; a recording is analysed, against `gpu_memory` bytes when given (the
    budget of a check: its plan is then the cheapest way under it). NoGpuMemory when no GPU holds memory."""
    p = check_path(path)
    run = _read(p, gpu_memory)
    if not run.devices:
        raise NoGpuMemory(p, "no GPU memory to check: no device holds allocations or their history (in a log: no "
                          "OOM message or memory line gives PyTorch's allocated bytes; nvidia-smi's are not)",
                          "Record the run with memory history on (analyzer.capture, or a profiler trace with "
                          "profile_memory=True), or log torch.cuda.memory_summary() at its peak.")
    return run


def _read(p: Path, gpu_memory: int | None) -> RunPeaks:
    kind = None if p.is_dir() else sniff(p)
    if kind == LOG:
        from analyzer.log_result import analyze_log

        return from_log(analyze_log(p), str(p))
    if kind == KINETO:
        head = _head(p)
        if _ANALYSIS.match(head):
            return from_document(_document(p), str(p))
        if _BASELINE.match(head):
            return from_baseline(_document(p), str(p))
        if _GOLDEN.match(head):
            return from_golden_values(_document(p), str(p))
    from analyzer.pipeline import analyze

    return from_document(analyze(p, gpu_memory).to_json(), str(p), kind=Kind.RECORDING, gpu_memory=gpu_memory)


def _head(path: Path) -> bytes:
    with open_input(path) as stream:
        return stream.read(_HEAD)


def _document(path: Path) -> dict[str, Any]:
    with open_input(path) as stream:
        raw = stream.read(MAX_DOCUMENT_BYTES + 1)
    if len(raw) > MAX_DOCUMENT_BYTES:
        raise ResourceLimit(path, f"a JSON summary larger than {MAX_DOCUMENT_BYTES >> 20} MiB",
                            "Pass the recording itself, or a baseline written by analyze check --write-baseline.")
    try:
        document = json.loads(raw)
    except (ValueError, RecursionError) as error:
        raise CorruptInput(path, f"not valid JSON ({str(error)[:120]})", "Pass the file unedited.") from None
    if not isinstance(document, dict):
        raise CorruptInput(path, "a JSON summary that is not an object", "Pass the file unedited.")
    return document


def from_golden_values(document: dict[str, Any], source: str) -> RunPeaks:
    """The peak Megatron-LM's golden values record: the largest finite `mem-max-allocated-bytes`, and every
    step's value (one device: a functional test's values are those of one rank)."""
    metric = document.get(MEGATRON_METRIC)
    values = metric.get("values") if isinstance(metric, dict) else None
    if not isinstance(values, dict):
        raise UnsupportedFormat(source, f"Megatron-LM golden values without {MEGATRON_METRIC!r} values",
                                "Record it (--log-memory-to-tensorboard) and regenerate the golden values, or pass "
                                "a recording or a baseline.")
    steps = []
    for step, value in values.items():
        number = _number(value)
        if number is not None and str(step).isdigit():
            steps.append(StepPeak(int(step), int(number)))
    if not steps:
        raise CorruptInput(source, f"no finite {MEGATRON_METRIC!r} value in the golden values",
                           "Regenerate them from a run that logged memory.")
    steps.sort(key=lambda s: s.step)
    peak = max(steps, key=lambda s: s.bytes)
    first = next(s for s in steps if s.bytes == peak.bytes)
    device = DevicePeak(device=0, rank=None, needed_bytes=peak.bytes, peak_bytes=peak.bytes, reserved_bytes=None,
                        oom=False, step=first.step, phase=None, module=None, steps=tuple(steps))
    return RunPeaks(source, Kind.MEGATRON, (device,))


#: the sizes of a memory line that are PyTorch's allocations, best first (nvidia-smi's `used` is the whole
#: process's, or another's: never gated)
_ALLOCATED = ("allocated_peak", "allocated")


def from_log(log: LogAnalysis, source: str) -> RunPeaks:
    """A log's peaks, one per (rank, device): at an OOM the memory it needed (allocated by PyTorch plus the
    request); else the largest allocated peak its memory lines report (memory_summary(), memory_stats(),
    Megatron, DeepSpeed, Lightning), with every step's where the lines name steps. nvidia-smi's used memory is
    not PyTorch's and is not gated; a log with neither gates nothing (NoGpuMemory)."""
    best: dict[tuple[int | None, int], DevicePeak] = {}

    def keep(peak: DevicePeak) -> None:
        key = (peak.rank, peak.device)
        if key not in best or peak.needed_bytes > best[key].needed_bytes:
            best[key] = peak

    steps: dict[tuple[int | None, int], dict[int, int]] = {}
    for reading in log.reading.readings:
        size = next((reading.bytes[k] for k in _ALLOCATED if k in reading.bytes), None)
        if size is None:
            continue
        key = (reading.rank, reading.device or 0)
        if reading.step is not None:
            by_step = steps.setdefault(key, {})
            by_step[reading.step] = max(by_step.get(reading.step, 0), size)
        keep(DevicePeak(device=key[1], rank=key[0], needed_bytes=size, peak_bytes=size,
                        reserved_bytes=reading.bytes.get("reserved_peak", reading.bytes.get("reserved")), oom=False,
                        step=reading.step, phase=None, module=None))
    for oom in log.ooms:
        text = oom.text
        if text.allocated_bytes is None or text.requested_bytes is None:
            continue
        keep(DevicePeak(device=text.device or 0, rank=text.rank, needed_bytes=text.allocated_bytes + text.requested_bytes,
                        peak_bytes=text.allocated_bytes, reserved_bytes=text.reserved_bytes, oom=True, step=None,
                        phase=oom.phase, module=None, findings=(oom.cause.reason,),
                        remedies=tuple(Option(str(r["id"]), str(r["title"]), None) for r in oom.remedies)))
    devices = tuple(replace(peak, steps=tuple(StepPeak(s, b) for s, b in sorted(steps.get(key, {}).items())))
                    for key, peak in sorted(best.items(), key=lambda kv: (kv[0][0] or 0, kv[0][1])))
    return RunPeaks(source, Kind.LOG, devices, tuple(log.warnings))


def _number(value: Any) -> float | None:
    """A finite number of bytes, or None for Megatron's "nan" and anything else that is not one."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) and value >= 0 else None
