"""`nvidia-smi`: the default screen, `--query-gpu`/`--query-compute-apps` CSV, and `torch.cuda.list_gpu_processes()`.

The screen: a GPU's first row `|   0  NVIDIA A100 ... On | 00000000:07:00.0 Off | 0 |` names its index, its
second row holds `used MiB / total MiB`; under `Processes:` each row is `| GPU [GI CI] PID Type Name Used MiB |`
(GI and CI since driver 450; older drivers print `N/A` or nothing there). The GPU's row is read back from its
memory row (a log is searched for "MiB", not for bus ids). CSV logs are read when their header
says which column is which (`--format=csv`, with or without `nounits`). A `noheader` log names its columns
only where the log holds the command that wrote it (`nvidia-smi --query-gpu=index,memory.used,...
--format=csv,noheader,nounits`): its rows are read after that line, in the order the query gives (nvidia-smi
prints the fields in the order asked, its aliases such as `used_memory` for `used_gpu_memory` included). Rows
without such a line are not read: `0, 1000, 81920` could be any three numbers. `list_gpu_processes()` prints
`GPU:n` then `process PID uses X MB GPU memory` per process, so a process's device is read back from the lines
before it.
"""
from __future__ import annotations

import re
from collections.abc import Callable

from analyzer.core.log_records import Reading
from analyzer.ingest.log.lines import decode
from analyzer.ingest.log.sizes import to_bytes

_GPU_ROW = re.compile(r"^\|\s*(\d+)\s+\S.*\|\s*[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.\d\s+\S+\s*\|")
_MEMORY = re.compile(r"\|\s*(\d+)\s*MiB\s*/\s*(\d+)\s*MiB\s*\|")
_PROCESS = re.compile(r"^\|\s*(\d+)\s+(?:(?:N/A|\d+)\s+(?:N/A|\d+)\s+)?(\d+)\s+(C|G|C\+G|M|M\+C)\s+(\S.*?)\s+(\d+)\s*MiB\s*\|")
_TORCH_GPU = re.compile(r"^GPU:(\d+)\s*$")
_TORCH_PROCESS = re.compile(r"process\s+(\d+) uses\s+(\d+(?:\.\d+)?) MB GPU memory")
_QUERY = re.compile(r"--query-(?:gpu|compute-apps)[= ]([\w.,]+)")
#: nvidia-smi's other names for the fields read here (`nvidia-smi --help-query-compute-apps`)
_ALIASES = {"used_memory": "used_gpu_memory"}
_CSV_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(MiB|GiB|KiB|B)?\s*$")


#: bytes read back from a memory or process row for its GPU's row (rows are under 200 bytes; twenty processes)
_BACK = 4096

Preceding = Callable[[int], list[tuple[int, bytes]]]


class NvidiaSmiReader:
    """Reads the screen's GPU and process rows, headed CSV logs and list_gpu_processes() output."""

    def __init__(self) -> None:
        self._columns: list[str] | None = None

    @property
    def busy(self) -> bool:
        """A CSV header names the columns of the rows that follow."""
        return self._columns is not None

    def feed(self, number: int, text: str, rank: int | None, preceding: Preceding) -> list[Reading]:
        """The readings of line `number`; `preceding(limit)` gives the raw lines before it."""
        if _GPU_ROW.match(text):
            return []
        memory = _MEMORY.search(text) if "MiB" in text else None
        if memory and text.lstrip().startswith("|"):
            before = preceding(_BACK)
            gpu = _GPU_ROW.match(decode(before[-1][1])[0]) if before else None
            if gpu is None:
                return []
            return [Reading(line=number, source="nvidia_smi", rank=rank, device=int(gpu.group(1)),
                            bytes={"used": int(memory.group(1)) << 20, "total": int(memory.group(2)) << 20})]
        process = _PROCESS.match(text) if "MiB" in text else None
        if process:
            return [Reading(line=number, source="nvidia_smi_process", rank=rank, device=int(process.group(1)),
                            label=f"pid {process.group(2)} {process.group(4)}",
                            bytes={"used": int(process.group(5)) << 20})]
        torch_process = _TORCH_PROCESS.search(text)
        if torch_process:
            return [Reading(line=number, source="nvidia_smi_process", rank=rank, device=_torch_gpu(preceding(_BACK)),
                            label=f"pid {torch_process.group(1)}",
                            bytes={"used": round(float(torch_process.group(2)) * 2**20)})]
        return self._csv(number, text, rank)

    def _csv(self, number: int, text: str, rank: int | None) -> list[Reading]:
        if (query := _QUERY.search(text)):  # the command: its columns when no header will name them
            self._columns = [_ALIASES.get(c, c) for c in query.group(1).split(",") if c] if "noheader" in text else None
            return []
        if "," not in text:
            self._columns = None
            return []
        cells = [c.strip() for c in text.split(",")]
        if any(c.startswith(("memory.used", "used_gpu_memory", "memory.total")) for c in cells):
            self._columns = [c.split(" [")[0] for c in cells]
            return []
        if self._columns is None or len(cells) != len(self._columns):
            return []
        row = dict(zip(self._columns, cells, strict=True))
        sizes = {}
        for column, key in (("memory.used", "used"), ("memory.total", "total"), ("used_gpu_memory", "used")):
            m = _CSV_SIZE.match(row.get(column, ""))
            if m:
                sizes[key] = to_bytes(m.group(1), m.group(2) or "MiB")
        if not sizes:
            return []
        index = row.get("index", "")
        pid = row.get("pid")
        return [Reading(line=number, source="nvidia_smi_process" if pid else "nvidia_smi_csv", rank=rank,
                        device=int(index) if index.isdigit() else None,
                        label=f"pid {pid} {row.get('process_name', '')}".strip() if pid else row.get("timestamp"),
                        bytes=sizes)]


def _torch_gpu(before: list[tuple[int, bytes]]) -> int | None:
    """The n of the `GPU:n` that heads the process lines just before (None if something else is above them)."""
    for _, raw in reversed(before):
        text = decode(raw)[0]
        if (gpu := _TORCH_GPU.match(text.strip())):
            return int(gpu.group(1))
        if not _TORCH_PROCESS.search(text):
            return None
    return None
