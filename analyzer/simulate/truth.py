"""The ground-truth sidecar (`<name>.truth.json`) of a simulated snapshot: what each allocation really was.

Keys of `allocations` are the index of the `alloc` entry in `device_traces[0]`, so a reader of the snapshot can
join them to its allocations table on `seq_alloc`. `measures` are computed here from the labels (the peak,
what was live at it, per-step and per-phase peaks); `findings` are what the scenario was built to show. A
detector that reads only the pickle can be scored against both.
"""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from analyzer.simulate.events import CATEGORIES
from analyzer.simulate.simulation import Simulation

TRUTH_FORMAT = "analyzer-simulate-truth/1"


def truth_path(snapshot: Path) -> Path:
    """`x.pickle` -> `x.truth.json`."""
    return snapshot.with_name(snapshot.stem + ".truth.json")


def measures(simulation: Simulation) -> dict[str, Any]:
    """Peak allocated bytes (block sizes, what memory_allocated() reports), its labels, and per-step/phase peaks."""
    live: dict[int, int] = {}          # addr -> trace index of the alloc
    allocated = peak = 0
    peak_live: list[int] = []
    peak_index = -1
    step_peaks: Counter = Counter()
    phase_peaks: Counter = Counter()
    current = None
    for index, entry in enumerate(simulation.allocator.trace):
        if entry["action"] == "alloc":
            live[entry["addr"]] = index
            allocated += simulation.block_sizes[index]
            current = simulation.labels[index]
        elif entry["action"] == "free_requested":
            allocated -= simulation.block_sizes[live.pop(entry["addr"])]
        else:
            continue
        if current is not None:
            step_peaks[current.step] = max(step_peaks[current.step], allocated)
            key = f"{current.step}:{current.phase}"
            phase_peaks[key] = max(phase_peaks[key], allocated)
        if allocated > peak:
            peak, peak_index, peak_live = allocated, index, list(live.values())
    by_category = Counter({c: 0 for c in CATEGORIES})
    for index in peak_live:
        by_category[simulation.labels[index].category] += simulation.block_sizes[index]
    at_peak = simulation.labels.get(peak_index) or (current if current else None)
    return {
        "peak_allocated_bytes": peak,
        "peak_trace_index": peak_index,
        "peak_phase": at_peak.phase if at_peak else None,
        "peak_step": at_peak.step if at_peak else None,
        "peak_by_category": dict(by_category),
        "peak_by_step": {str(k): v for k, v in sorted(step_peaks.items())},
        "peak_by_step_phase": dict(sorted(phase_peaks.items())),
    }


def truth_dict(simulation: Simulation, scenario: str, gpu_memory: int | None, steps: int,
               findings: dict[str, Any]) -> dict[str, Any]:
    allocations = {
        str(index): {"bytes": label.nbytes, "allocated_bytes": simulation.block_sizes[index],
                     "category": label.category, "module": label.module, "module_class": label.module_class,
                     "phase": label.phase, "step": label.step}
        for index, label in simulation.labels.items()
    }
    oom = None
    if simulation.oom is not None:
        error, label = simulation.oom_error, simulation.oom
        assert error is not None, "simulate() sets oom and oom_error together"
        oom = {"trace_index": len(simulation.allocator.trace) - 1, "requested_bytes": error.requested,
               "rounded_bytes": error.rounded, "segment_bytes": error.alloc_size, "device_free": error.device_free,
               "allocated_bytes": error.allocated, "reserved_bytes": error.reserved,
               "largest_free_block": max((b.size for b in simulation.allocator.all_blocks() if not b.allocated),
                                         default=0),
               "category": label.category, "module": label.module, "phase": label.phase, "step": label.step}
    return {"format": TRUTH_FORMAT, "scenario": scenario, "device": 0, "gpu_memory": gpu_memory, "steps": steps,
            "allocations": allocations, "oom": oom, "measures": measures(simulation), "findings": findings}


def write_truth(truth: dict[str, Any], path: Path) -> None:
    path.write_text(json.dumps(truth, indent=1, sort_keys=True) + "\n")
