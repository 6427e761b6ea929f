"""What a text log holds, as typed values: the OOM messages and the memory readings the log readers
(analyzer.ingest.log) produce and the log's diagnosis (analyzer.log_diagnose) judges. Plain data, below both,
as the shared tables are for recordings."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypedDict


class Era:
    """Which form of the message a text is: it names the torch versions and what its numbers mean."""

    CACHED = "torch<=1.3"        # "... C cached)"
    RESERVED = "torch1.4-2.0"    # "... R reserved in total by PyTorch)"
    OF_WHICH = "torch>=2.1"      # "... of which F is free ..."
    MPS = "mps"
    OUTSIDE = "outside_allocator"  # an OOM outside the caching allocator: no numbers
    PARTIAL = "partial"          # the message starts but its numbers are cut off


@dataclass(frozen=True, kw_only=True)
class OomText:
    """One out-of-memory message as read: every number as bytes, None where the form does not print it."""

    line: int
    rank: int | None
    era: str
    backend: str                          # CUDA, HIP, XPU, MPS
    source: str = "caching_allocator"     # or cuda_error, cublas, nccl, thcudacheck
    device: int | None = None
    requested_bytes: int | None = None
    capacity_bytes: int | None = None
    free_bytes: int | None = None
    allowed_bytes: int | None = None
    allocated_bytes: int | None = None    # by PyTorch (private pools included)
    reserved_bytes: int | None = None     # by PyTorch: allocated + reserved but unallocated
    unallocated_bytes: int | None = None  # reserved but unallocated ("cached" before 1.4)
    this_process_bytes: int | None = None  # NVML: this process, non-PyTorch memory included
    processes: tuple[tuple[int, int], ...] = ()  # NVML: (pid, bytes) of every other process listed
    private_pool_bytes: int | None = None
    malloc_at: str | None = None          # "CUDACachingAllocator.cpp:289": the torch build's line
    tolerance_bytes: int = 0              # how far the printed numbers can be from the true ones, summed
    text: str = ""
    repeats: int = 1                      # the same message printed again (chained exceptions, loggers)
    frames: tuple[tuple[str, int, str, str], ...] = field(default=())  # the traceback: (file, line, function, code)

    def same_event(self, other: OomText) -> bool:
        """The same OOM printed twice: same device, rank and numbers."""
        keys = ("rank", "era", "device", "requested_bytes", "free_bytes", "allocated_bytes", "unallocated_bytes",
                "reserved_bytes", "source")
        return all(getattr(self, k) == getattr(other, k) for k in keys)


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


class LogRemedy(TypedDict):
    """One remedy for a log's OOM (analyzer.log_diagnose.advice), cheapest first."""

    id: str
    title: str
    detail: str
    bytes: int | None             # what it frees, where the text gives it
    code: str | None


class _LogFound(TypedDict):
    kind: str                     # leak | imbalance | serving_kv_cache | serving_startup
    summary: str


class LogFinding(_LogFound, total=False):
    """What a log's memory lines show across it (analyzer.log_diagnose.trends, advice): the common keys,
    then each kind's own."""

    source: str                   # leak: the series' reader
    rank: int | None              # leak, imbalance
    device: int | None            # leak, serving_*
    label: str | None             # leak
    readings: int
    first_line: int
    last_line: int
    first_bytes: int
    last_bytes: int
    growth_bytes: int
    per_reading_bytes: int
    peak_bytes: int               # imbalance
    median_bytes: int
    ranks: dict[int, int]
    cause: str                    # serving_*: a log_diagnose.cause cause
    line: int
    remedy: str
    free_bytes: int               # serving_startup
    total_bytes: int
    wanted_bytes: int
    held_elsewhere_bytes: int


class GpuPeak(TypedDict):
    """One GPU's highest nvidia-smi use in the log."""

    device: int | None          # None: a CSV queried without `index`, its rows not told apart by GPU
    used_bytes: int
    total_bytes: int | None
    line: int
    readings: int


class MemoryHigh(TypedDict):
    """The highest a series of memory lines (one reader, rank and device: Megatron's rank 3, DeepSpeed's
    see_memory_usage, vLLM's profile) reached in the log, for each size it prints (READING_WORDS)."""

    source: str
    rank: int | None
    device: int | None
    readings: int
    first_line: int
    last_line: int
    bytes: dict[str, int]         # each size's highest (its lowest for "available": the room left)
    counts: dict[str, int]        # memory_summary()'s OOMs and allocation retries, their highest
    summary: str


#: the sizes a reading's `bytes` may hold that a log's summary names, in the order it names them, with their
#: words; a peak ("allocated_peak") stands for its current value ("allocated") where a line prints both
READING_WORDS = {"allocated_peak": "allocated at peak", "allocated": "allocated", "reserved_peak": "reserved at peak",
                 "reserved": "reserved", "weights": "weights", "kv_cache": "KV cache",
                 "activation_peak": "activation peak", "non_torch": "outside PyTorch", "budget": "budget",
                 "total": "total", "available": "available at the lowest"}
#: sizes whose lowest, not highest, reading is the one that matters: the memory a process still had
LOWEST_IS_WORST = frozenset({"available"})


def gpu_name(device: int | None) -> str:
    """How a report names the GPU of an nvidia-smi reading."""
    return f"GPU {device}" if device is not None else "a GPU the log does not number"


class GpuProcess(TypedDict):
    """A process nvidia-smi listed, at its last reading."""

    device: int | None
    process: str | None
    used_bytes: int
    line: int
