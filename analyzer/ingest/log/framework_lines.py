"""Memory lines that training and serving frameworks print, each as a Reading.

- Megatron-LM `report_memory` (megatron/training/utils.py): `[Rank r] (after N iterations) memory (MB) |
  allocated: a | max allocated: b | reserved: c | max reserved: d`, the "MB" being MiB (bytes / 1024 / 1024),
  printed before 2021 (megatron/utils.py) without the rank and the brackets: `after N iterations memory (MB) | ...`;
  and Megatron-Bridge's `[Rank r] (after N iterations) memory (GB) | mem-allocated-gigabytes: x |
  mem-max-allocated-gigabytes: y | ...` (src/megatron/bridge/training/utils/train_utils.py, `training_log` and
  `report_memory`: the bytes of `torch.cuda.memory_stats()` / 1.0e9 to five significant digits, so "gigabytes"
  are 10**9 bytes, not GiB).
- DeepSpeed `see_memory_usage` (deepspeed/runtime/utils.py): the message line, then `MA a GB  Max_MA b GB
  CA c GB  Max_CA d GB` (GiB; Max_CA rounded to a whole GiB).
- Lightning/NeMo and hand-written logs: `max_memory_reserved`, `max_memory_allocated`, `memory_reserved`,
  `memory_allocated` followed by `=` or `:` and a size with its unit.
- vLLM's memory profiling (worker.py, gpu_worker.py): `total_gpu_memory (T) x gpu_memory_utilization (u) = B`,
  `model weights take W; non_torch_memory takes N; PyTorch activation peak memory takes P; the rest of the
  memory reserved for KV Cache is K`, `Available KV cache memory: K`, and the start-up refusal `Free memory on
  device (F/T GiB) on startup is less than desired GPU memory utilization (u, B GiB)`.
- vLLM's KV-cache refusals: `No available memory for the cache blocks` and `The model's max seq len (n) is
  larger than the maximum number of tokens that can be stored in KV cache (m)`.
- SGLang (model_runner.py): `Not enough memory. Please try to increase --mem-fraction-static`, `Load weight end. ... avail mem=A GB, mem usage=W GB`, `KV Cache is allocated.
  ... K size: k GB, V size: v GB`, `Memory pool end. avail mem=A GB` (GB = 2**30 bytes there).
"""
from __future__ import annotations

import re

from analyzer.core.log_records import Reading
from analyzer.ingest.log.sizes import SIZE, to_bytes

_N = r"(\d+(?:\.\d+)?)"
_MEGATRON_MB = re.compile(r"(?:\[Rank (\d+)\] )?(?:\(?after (\d+) iterations\)?|\([^)]*\)) memory \(MB\) \| "
                          r"allocated: " + _N
                          + r" \| max allocated: " + _N + r" \| reserved: " + _N + r" \| max reserved: " + _N)
#: a Megatron line as Megatron prints it (either era), alone on its line but for torchrun's `[rankN]: ` and a
#: carriage return, in ASCII: cleaning leaves its text as it is and no other reader acts on it (none of their
#: words is in it), so while no reader is inside something (a wrapped message, a table) lines.Scan reads it from
#: its bytes, without decoding it, to the same Reading as _MEGATRON_MB (`_megatron_mb` makes both). A long run's
#: log is mostly these among its matched lines: 224,070 of the benchmark's 2 GB (bench_log.py)
QUICK = re.compile(rb"(?:\[(?:rank|default)(\d+)\]:? ?)?(?:\[Rank (\d+)\] )?\(?after (\d+) iterations\)? memory \(MB\) \| "
                   rb"allocated: (\d+(?:\.\d+)?) \| max allocated: (\d+(?:\.\d+)?) \| reserved: (\d+(?:\.\d+)?) \| "
                   rb"max reserved: (\d+(?:\.\d+)?)\r?")
_MEGATRON_GB = re.compile(r"mem-([a-z\-]+)-(giga|mega)bytes:\s*" + _N)
_MEGATRON_GB_HEAD = re.compile(r"(?:\[Rank (\d+)\] )?\(after (\d+) iterations\) memory \(GB\)")
_ITERATION = re.compile(r"\biteration\s+(\d+)\s*/")
_DEEPSPEED = re.compile(r"\bMA " + _N + r" GB\s+Max_MA " + _N + r" GB\s+CA " + _N + r" GB\s+Max_CA " + _N + r" GB")
_DEEPSPEED_LABEL = re.compile(r"see_memory_usage\]\s*(.*\S)\s*$")
_TORCH_CALLS = re.compile(r"\b(max_memory_reserved|max_memory_allocated|memory_reserved|memory_allocated)\b\(?\)?"
                          r"\s*[=:]\s*" + SIZE)
_VLLM_BUDGET = re.compile(r"total_gpu_memory \(" + SIZE + r"\) x gpu_memory_utilization \(" + _N + r"\) = " + SIZE)
_VLLM_SPLIT = re.compile(r"model weights take " + SIZE + r"; non_torch_memory takes " + SIZE
                         + r"; PyTorch activation peak memory takes " + SIZE
                         + r"; the rest of the memory reserved for KV Cache is " + SIZE)
_VLLM_KV = re.compile(r"Available KV cache memory: " + SIZE)
_VLLM_STARTUP = re.compile(r"Free memory on device(?: \w+:(\d+))? \(" + _N + r"/" + _N + r" GiB\) on startup is less than desired "
                           r"GPU memory utilization \(" + _N + r", " + _N + r" GiB\)")
_VLLM_NO_CACHE = re.compile(r"No available memory for the cache blocks")
_VLLM_MAX_LEN = re.compile(r"max seq len \((\d+)\) is larger than the maximum number of tokens that can be stored in KV "
                           r"cache \((\d+)\)")
_SGLANG_NOT_ENOUGH = re.compile(r"Not enough memory\. Please try to increase --mem-fraction-static")
_SGLANG_LOAD = re.compile(r"Load weight end\..*?avail mem=" + _N + r" GB, mem usage=" + _N + r" GB")
_SGLANG_KV = re.compile(r"KV Cache is allocated\..*?K size: " + _N + r" GB, V size: " + _N + r" GB")
_SGLANG_POOL = re.compile(r"Memory pool end\. avail mem=" + _N + r" GB")

_GIB, _MIB = 2**30, 2**20


def _g(value: str) -> int:
    return round(float(value) * _GIB)


def _megatron_mb(number: int, rank: int | None, named: str | bytes | None, step: str | bytes | None,
                 allocated: str | bytes, allocated_peak: str | bytes, reserved: str | bytes,
                 reserved_peak: str | bytes) -> Reading:
    """The Reading of a `memory (MB)` line from its groups (text or bytes: int and float read both alike)."""
    return Reading(line=number, source="megatron", rank=int(named) if named else rank,
                   step=int(step) if step else None,
                   bytes={"allocated": round(float(allocated) * _MIB),
                          "allocated_peak": round(float(allocated_peak) * _MIB),
                          "reserved": round(float(reserved) * _MIB),
                          "reserved_peak": round(float(reserved_peak) * _MIB)})


class FrameworkLinesReader:
    """Reads the lines above; remembers DeepSpeed's message line for the numbers that follow it."""

    def __init__(self) -> None:
        self._deepspeed_label: str | None = None
        self.seen: set[str] = set()

    def feed(self, number: int, text: str, rank: int | None) -> list[Reading]:
        read = self._read(number, text, rank)
        if read:
            self.seen.add(read.source)
            return [read]
        return []

    def quick(self, number: int, match: re.Match[bytes], keep: bool) -> Reading | None:
        """A line QUICK matched, as feed reads it: its Reading, made only when it is to be `keep`t."""
        self.seen.add("megatron")
        if not keep:
            return None
        prefix, named, step, allocated, allocated_peak, reserved, reserved_peak = match.groups()
        return _megatron_mb(number, int(prefix) if prefix else None, named, step, allocated, allocated_peak, reserved,
                            reserved_peak)

    def _read(self, number: int, text: str, rank: int | None) -> Reading | None:
        if "MB)" in text and (m := _MEGATRON_MB.search(text)):
            return _megatron_mb(number, rank, *m.groups())
        if "mem-" in text and (pairs := _MEGATRON_GB.findall(text)):
            head = _MEGATRON_GB_HEAD.search(text)
            step = head.group(2) if head else (it.group(1) if (it := _ITERATION.search(text)) else None)
            names = {"allocated": "allocated", "max-allocated": "allocated_peak", "reserved": "reserved",
                     "max-reserved": "reserved_peak"}
            values = {names[n]: round(float(v) * (10**9 if unit == "giga" else 10**6)) for n, unit, v in pairs if n in names}
            return Reading(line=number, source="megatron", rank=int(head.group(1)) if head and head.group(1) else rank,
                           step=int(step) if step else None, bytes=values) if values else None
        if "see_memory_usage" in text and (label := _DEEPSPEED_LABEL.search(text)) and not _DEEPSPEED.search(text):
            self._deepspeed_label = label.group(1) if not label.group(1).startswith("CPU Virtual") else self._deepspeed_label
        if "Max_MA" in text and (m := _DEEPSPEED.search(text)):
            return Reading(line=number, source="deepspeed", rank=rank, label=self._deepspeed_label,
                           bytes={"allocated": _g(m.group(1)), "allocated_peak": _g(m.group(2)),
                                  "reserved": _g(m.group(3)), "reserved_peak": _g(m.group(4))})
        if "memory_" in text and (calls := _TORCH_CALLS.findall(text)):
            names = {"max_memory_reserved": "reserved_peak", "max_memory_allocated": "allocated_peak",
                     "memory_reserved": "reserved", "memory_allocated": "allocated"}
            return Reading(line=number, source="torch_calls", rank=rank,
                           bytes={names[n]: to_bytes(v, u) for n, v, u in calls})
        return self._serving(number, text, rank)

    def _serving(self, number: int, text: str, rank: int | None) -> Reading | None:
        if (m := _VLLM_BUDGET.search(text)):
            return Reading(line=number, source="vllm", rank=rank, label="budget",
                           bytes={"total": to_bytes(m.group(1), m.group(2)), "budget": to_bytes(m.group(4), m.group(5))},
                           counts={"gpu_memory_utilization_percent": round(float(m.group(3)) * 100)})
        if (m := _VLLM_SPLIT.search(text)):
            return Reading(line=number, source="vllm", rank=rank, label="profile",
                           bytes={"weights": to_bytes(m.group(1), m.group(2)), "non_torch": to_bytes(m.group(3), m.group(4)),
                                  "activation_peak": to_bytes(m.group(5), m.group(6)),
                                  "kv_cache": to_bytes(m.group(7), m.group(8))})
        if (m := _VLLM_KV.search(text)):
            return Reading(line=number, source="vllm", rank=rank, label="kv_cache",
                           bytes={"kv_cache": to_bytes(m.group(1), m.group(2))})
        if (m := _VLLM_STARTUP.search(text)):
            return Reading(line=number, source="vllm", rank=rank, label="startup_refused",
                           device=int(m.group(1)) if m.group(1) else None,
                           bytes={"free": _g(m.group(2)), "total": _g(m.group(3)), "budget": _g(m.group(5))},
                           counts={"gpu_memory_utilization_percent": round(float(m.group(4)) * 100)})
        if _VLLM_NO_CACHE.search(text):
            return Reading(line=number, source="vllm", rank=rank, label="no_kv_cache")
        if (m := _VLLM_MAX_LEN.search(text)):
            return Reading(line=number, source="vllm", rank=rank, label="kv_cache_too_small",
                           counts={"max_model_len": int(m.group(1)), "kv_cache_tokens": int(m.group(2))})
        if _SGLANG_NOT_ENOUGH.search(text):
            return Reading(line=number, source="sglang", rank=rank, label="no_kv_cache")
        if (m := _SGLANG_LOAD.search(text)):
            return Reading(line=number, source="sglang", rank=rank, label="weights_loaded",
                           bytes={"available": _g(m.group(1)), "weights": _g(m.group(2))})
        if (m := _SGLANG_KV.search(text)):
            return Reading(line=number, source="sglang", rank=rank, label="kv_cache",
                           bytes={"kv_cache": _g(m.group(1)) + _g(m.group(2))})
        if (m := _SGLANG_POOL.search(text)):
            return Reading(line=number, source="sglang", rank=rank, label="memory_pool",
                           bytes={"available": _g(m.group(1))})
        return None
