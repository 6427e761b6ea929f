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
from pathlib import Path
from typing import Any

from analyzer.errors import CorruptInput, ResourceLimit, UnsupportedFormat
from analyzer.gate.summary import BASELINE_PREFIX, DevicePeak, Kind, RunPeaks, StepPeak, from_baseline, from_document
from analyzer.ingest.sniff import KINETO, check_path, open_input, sniff

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
        raise NoGpuMemory(p, "no GPU memory to check: no device holds allocations or their history",
                          "Record the run with memory history on (analyzer.capture, or a profiler trace with "
                          "profile_memory=True).")
    return run


def _read(p: Path, gpu_memory: int | None) -> RunPeaks:
    if not p.is_dir() and sniff(p) == KINETO:
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


def _number(value: Any) -> float | None:
    """A finite number of bytes, or None for Megatron's "nan" and anything else that is not one."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) and value >= 0 else None
