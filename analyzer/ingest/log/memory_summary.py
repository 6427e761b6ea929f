"""`torch.cuda.memory_summary()` tables and `torch.cuda.memory_stats()` dicts.

The table (torch/cuda/memory.py, `memory_summary`): a header `PyTorch CUDA memory summary, device ID n`, a line
`CUDA OOMs: n | cudaMalloc retries: n`, then per metric a row `| Allocated memory | cur | peak | tot alloc |
tot freed |` and its `from large pool` / `from small pool` rows. Sizes are `_format_size`'s: binary multiples
written `B`/`KB`/`MB`/`GB` before torch 1.8 and `B`/`KiB`/`MiB`/`GiB` since. The pool rows are kept as `allocated_large`,
`allocated_small_peak` and so on. "Non-releasable memory" is the inactive split bytes: freed blocks that share a segment with live ones (fragmentation).

The dict (`memory_stats()`, printed as a dict or an OrderedDict): its keys are read where they hold bytes or
counts this analysis uses, including the newer per-category and per-module totals (`component_bytes.*`,
`module_bytes.*`) where a torch build prints them.
"""
from __future__ import annotations

import re

from analyzer.core.log_records import Reading
from analyzer.ingest.log.sizes import SIZE, to_bytes

_HEADER = re.compile(r"PyTorch (?:CUDA|HIP|XPU)? ?memory summary, device ID (\d+)")
_COUNTS = re.compile(r"CUDA OOMs:\s*(\d+)\s*\|\s*cudaMalloc retries:\s*(\d+)")
_METRICS = {"Allocated memory": "allocated", "Active memory": "active", "Requested memory": "requested",
            "GPU reserved memory": "reserved", "Non-releasable memory": "inactive_split"}
_ROW = re.compile(r"^\|\s*(" + "|".join(_METRICS) + r")\s*\|\s*" + SIZE + r"\s*\|\s*" + SIZE + r"\s*\|")
_POOL_ROW = re.compile(r"^\|\s*from (large|small) pool\s*\|\s*" + SIZE + r"\s*\|\s*" + SIZE + r"\s*\|")
_STAT = re.compile(r"""['"]((?:allocated|reserved|active|inactive_split|requested)_bytes\.all\.(?:current|peak)|"""
                   r"""num_ooms|num_alloc_retries|(?:component|module)_bytes\.[\w.\-]+)['"]\s*[:,]\s*(\d+)""")
_STAT_NAMES = {"allocated_bytes.all.current": "allocated", "allocated_bytes.all.peak": "allocated_peak",
               "reserved_bytes.all.current": "reserved", "reserved_bytes.all.peak": "reserved_peak",
               "active_bytes.all.current": "active", "active_bytes.all.peak": "active_peak",
               "inactive_split_bytes.all.current": "inactive_split",
               "inactive_split_bytes.all.peak": "inactive_split_peak",
               "requested_bytes.all.current": "requested", "requested_bytes.all.peak": "requested_peak"}
_COUNT_NAMES = {"num_ooms": "ooms", "num_alloc_retries": "alloc_retries"}


class MemorySummaryReader:
    """Reads summary tables across their lines and stats dicts on theirs."""

    def __init__(self) -> None:
        self._table: Reading | None = None
        self._metric: str | None = None      # the metric whose pool rows follow
        self._stats: Reading | None = None   # a dict printed over several lines (pprint) is one reading

    @property
    def busy(self) -> bool:
        """Inside a table or a dict printed over several lines."""
        return self._table is not None or self._stats is not None

    def feed(self, number: int, text: str, rank: int | None) -> list[Reading]:
        out: list[Reading] = []
        header = _HEADER.search(text) if "memory summary" in text else None
        if header:
            out += self.finish()
            self._table = Reading(line=number, source="memory_summary", rank=rank, device=int(header.group(1)))
            return out
        if self._table is not None:
            if not text.lstrip().startswith("|"):
                out += self.finish()
            else:
                counts = _COUNTS.search(text)
                if counts:
                    self._table.counts.update(ooms=int(counts.group(1)), alloc_retries=int(counts.group(2)))
                row = _ROW.match(text.strip())
                if row:
                    self._metric = name = _METRICS[row.group(1)]
                    self._table.bytes[name] = to_bytes(row.group(2), row.group(3))
                    self._table.bytes[f"{name}_peak"] = to_bytes(row.group(4), row.group(5))
                pool = _POOL_ROW.match(text.strip())
                if pool and self._metric:
                    self._table.bytes[f"{self._metric}_{pool.group(1)}"] = to_bytes(pool.group(2), pool.group(3))
                    self._table.bytes[f"{self._metric}_{pool.group(1)}_peak"] = to_bytes(pool.group(4), pool.group(5))
                return out
        stats = _STAT.findall(text) if "_bytes." in text or "num_" in text else []
        if not stats:
            return out + self._finish_stats()
        if self._stats is None:
            self._stats = Reading(line=number, source="memory_stats", rank=rank)
        for key, value in stats:
            if key in _COUNT_NAMES:
                self._stats.counts[_COUNT_NAMES[key]] = int(value)
            else:
                self._stats.bytes[_STAT_NAMES.get(key, key)] = int(value)
        if text.rstrip().endswith(("}", ")])", ")]")):
            out += self._finish_stats()
        return out

    def _finish_stats(self) -> list[Reading]:
        stats, self._stats = self._stats, None
        return [stats] if stats is not None else []

    def finish(self) -> list[Reading]:
        table, self._table, self._metric = self._table, None, None
        return ([table] if table is not None and table.bytes else []) + self._finish_stats()
