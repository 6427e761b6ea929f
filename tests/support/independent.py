"""Reference computations written for the tests only: they share no code with analyzer, so agreeing with
them means something. Pickles are read with a refusing find_class, as everywhere."""
from __future__ import annotations

import gzip
import pickle
from pathlib import Path


class _Refuse(pickle.Unpickler):
    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"refused {module}.{name}")


def read_snapshot(path: Path):
    with open(path, "rb") as f:
        head = f.read(2)
    opener = gzip.open if head == b"\x1f\x8b" else open
    with opener(path, "rb") as f:
        data = _Refuse(f).load()
    if isinstance(data, list):
        data = {"segments": data, "device_traces": []}
    return data


def segment_sums(data) -> dict[int, tuple[int, int, int]]:
    """Per device: (sum of allocated_size, sum of total_size, sum of requested_size) over the final segments."""
    out: dict[int, list[int]] = {}
    for s in data["segments"]:
        acc = out.setdefault(s["device"], [0, 0, 0])
        acc[0] += s["allocated_size"]
        acc[1] += s["total_size"]
        acc[2] += s["requested_size"]
    return {d: tuple(v) for d, v in out.items()}


def requested_peak(data, device: int) -> int:
    """Highest requested bytes over the device's trace, anchored so that it ends at the final live requests."""
    trace = data["device_traces"][device] if device < len(data.get("device_traces") or []) else []
    level, levels = 0, [0]
    freed_pending: set[int] = set()
    for e in trace:
        a = e["action"]
        if a == "alloc":
            level += e["size"]
        elif a == "free_requested":
            level -= e["size"]
            freed_pending.add(e["addr"])
        elif a == "free_completed":
            if e["addr"] in freed_pending:
                freed_pending.discard(e["addr"])
            else:
                level -= e["size"]
        levels.append(level)
    end_requested = sum(b["requested_size"] for s in data["segments"] if s["device"] == device
                        for b in s["blocks"] if b["state"] == "active_allocated")
    offset = end_requested - level
    return offset + max(levels)
