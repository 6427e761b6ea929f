"""Replay the allocation requests of a recorded trace through the allocator model.

A recording's alloc and free entries are the requests the program made (sizes, streams, order); everything
else in it (segment_alloc, block sizes, addresses) is what the real allocator decided. Feeding the requests
to the model and comparing its decisions with the recorded ones measures how faithful the model is; feeding
them with other settings (expandable segments on, a smaller device) answers "what would have happened".

Frees are replayed at `free_completed` (when the block became reusable), or at `free_requested` in
recordings that have no completions. A burst of `segment_free` / `segment_unmap` entries is replayed as
`empty_cache()`: either the program called it, or a failed cudaMalloc made the allocator release its cache,
which the model does the same way when it is given the device's capacity.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from analyzer.simulate.allocator import AllocatorSettings, CachingAllocator, SimulatedOutOfMemory
from analyzer.simulate.blocks import Block, CallContext
from analyzer.simulate.device import DeviceMemory

_RELEASES = ("segment_free", "segment_unmap")


@dataclass
class Replay:
    """The model after the replay, and which model block served each recorded alloc (by trace index)."""

    allocator: CachingAllocator
    blocks: dict[int, Block] = field(default_factory=dict)
    oom_at: int | None = None       # trace index of the alloc the model could not serve


def replay(trace: Sequence[dict[str, Any]], settings: AllocatorSettings = AllocatorSettings(),
           capacity: int | None = None, same_addresses: bool = False) -> Replay:
    """Run the recorded requests through a fresh model; stops at the first request the model cannot serve.

    With `same_addresses`, the model's cudaMallocs return the recorded segment addresses (while its segment
    sizes agree with the recording), so that ties between equal blocks, broken by address, break the same way.
    """
    recorded = [(e["size"], e["addr"]) for e in trace if e["action"] == "segment_alloc"] if same_addresses else None
    result = Replay(CachingAllocator(DeviceMemory(capacity, recorded_addresses=recorded), settings))
    model = result.allocator
    free_action = "free_completed" if any(e["action"] == "free_completed" for e in trace) else "free_requested"
    live: dict[int, Block] = {}
    previous = None
    for index, entry in enumerate(trace):
        action = entry["action"]
        ctx = CallContext(entry.get("time_us") or 0, [])
        if action == "alloc":
            try:
                block = model.malloc(entry["size"], entry.get("stream", 0), ctx)
            except SimulatedOutOfMemory:
                result.oom_at = index
                return result
            live[entry["addr"]] = block
            result.blocks[index] = block
        elif action == free_action:
            freed = live.pop(entry["addr"], None)
            if freed is not None:
                model.free(freed, ctx)
        elif action in _RELEASES and previous not in _RELEASES:
            model.empty_cache(ctx)
        previous = action
    return result
