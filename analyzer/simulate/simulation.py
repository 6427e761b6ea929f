"""Replay a traced run through the allocator model on a device of a given size: the simulated GPU run.

The trace was recorded on the CPU, where nothing runs out; here each allocation meets the caching allocator
and the device capacity. At the first request the allocator cannot serve, the run stops, as the real program
would with torch.OutOfMemoryError, and the snapshot shows the state at that moment (what an OOM observer or
an `except OutOfMemoryError: _dump_snapshot()` would save).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from analyzer.core.vocabulary import SEPARATOR
from analyzer.simulate.allocator import AllocatorSettings, CachingAllocator, SimulatedOutOfMemory
from analyzer.simulate.blocks import Block, CallContext
from analyzer.simulate.device import DeviceMemory
from analyzer.simulate.events import UID_MARK, Alloc, Annotation, Free, TracedRun
from analyzer.simulate.snapshot_writer import snapshot_dict


@dataclass
class Simulation:
    """The allocator after the run, the labels of each alloc entry (by trace index) and the OOM if one happened."""

    allocator: CachingAllocator
    labels: dict[int, Alloc] = field(default_factory=dict)
    block_sizes: dict[int, int] = field(default_factory=dict)
    annotations: list[dict[str, Any]] = field(default_factory=list)
    oom: Alloc | None = None
    oom_error: SimulatedOutOfMemory | None = None

    def snapshot(self) -> dict[str, Any]:
        return snapshot_dict(self.allocator, self.annotations)


def _resolve_uid(name: str, blocks: dict[int, Block]) -> str | None:
    """`tensor::…::uid:<n>` marks name a storage; on a device it is named by its address (None: not on it)."""
    head, sep, uid = name.rpartition(SEPARATOR + UID_MARK)
    if not sep:
        return name
    block = blocks.get(int(uid))
    return None if block is None else f"{head}{SEPARATOR}{block.addr:#x}"


def simulate(run: TracedRun, capacity: int | None, settings: AllocatorSettings = AllocatorSettings(),
             used_outside: int = 0) -> Simulation:
    """Feed the traced allocations, frees and annotations, in order, to a fresh allocator model."""
    result = Simulation(CachingAllocator(DeviceMemory(capacity, used_outside), settings))
    allocator = result.allocator
    blocks: dict[int, Block] = {}
    for event in run.events:
        if isinstance(event, Alloc):
            try:
                blocks[event.uid] = allocator.malloc(event.nbytes, event.stream, CallContext(event.time_us, event.frames))
            except SimulatedOutOfMemory as error:
                result.oom, result.oom_error = event, error
                break
            index = len(allocator.trace) - 1
            result.labels[index] = event
            result.block_sizes[index] = blocks[event.uid].size
        elif isinstance(event, Free):
            block = blocks.pop(event.uid, None)
            if block is not None:
                assert block.context is not None, "a live block keeps the context of its malloc"
                frames = block.context.frames if event.frames is None else event.frames
                allocator.free(block, CallContext(event.time_us, frames))
        elif isinstance(event, Annotation):
            name = _resolve_uid(event.name, blocks)
            if name is not None:
                result.annotations.append({"stage": event.stage, "name": name, "device": 0, "time_us": event.time_us})
    return result
