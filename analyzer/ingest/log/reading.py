"""What the readers of a log produce: one typed value per thing read, and the whole reading of a file."""
from __future__ import annotations

from dataclasses import dataclass, field

from analyzer.ingest.log.oom_message import OomText


@dataclass(frozen=True, kw_only=True)
class Reading:
    """One memory reading at one moment: a memory_summary() table, a memory_stats() dict, an nvidia-smi row or a
    framework's line. `bytes` holds sizes ("allocated", "allocated_peak", "reserved", "reserved_peak", "used",
    "total", ...), `counts` numbers that are not sizes ("ooms", "alloc_retries")."""

    line: int
    source: str                      # which form: memory_summary, memory_stats, nvidia_smi, megatron, ...
    rank: int | None = None
    device: int | None = None
    label: str | None = None         # what the line says it measured ("before forward", "pid 123 python")
    step: int | None = None
    bytes: dict[str, int] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class AllocatorSetting:
    """PYTORCH_CUDA_ALLOC_CONF (or PYTORCH_ALLOC_CONF) as the log shows it set, with its line."""

    line: int
    value: str


@dataclass(frozen=True, kw_only=True)
class LogReading:
    """Everything read from one text: the OOMs in order, the readings in order, and what was set."""

    path: str
    lines: int
    ooms: list[OomText]
    readings: list[Reading]
    settings: list[AllocatorSetting]
    frameworks: list[str]            # the frameworks whose lines were seen (vllm, sglang, deepspeed, megatron)
    warnings: list[str] = field(default_factory=list)
