"""Write the allocator model's state and history as `torch.cuda.memory._snapshot()` does (torch 2.13 layout).

Segments are listed by address with their blocks tiling them; an expandable segment is reported as one
segment per contiguous mapped range, as `DeviceCachingAllocator::snapshot` does. `_dump_snapshot` pickles the
dict with the pickle module's default protocol, 4.
"""
from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

from analyzer.simulate.allocator import AllocatorSettings, CachingAllocator
from analyzer.simulate.blocks import Block

PICKLE_PROTOCOL = 4
_ROUNDUP_KEYS = [str(1 << i) for i in range(16)]   # interval starts in MiB, as torch lists them


def segment_dicts(allocator: CachingAllocator) -> list[dict[str, Any]]:
    """The `segments` list: one entry per cudaMalloc'd segment or mapped range, sorted by address."""
    segments = []
    for head in allocator.all_blocks():
        if head.prev is not None and head.prev.mapped:
            continue
        blocks, total, allocated, active, requested = [], 0, 0, 0, 0
        block: Block | None = head
        while block is not None and block.mapped:
            state = "active_allocated" if block.allocated else "inactive"
            blocks.append({"address": block.addr, "size": block.size, "requested_size": block.requested,
                           "state": state, "frames": block.context.frames if block.context else []})
            total += block.size
            if block.allocated:
                allocated += block.size
                active += block.size
                requested += block.requested
            block = block.next
        segments.append({
            "device": allocator.device_index, "address": head.addr, "total_size": total,
            "allocated_size": allocated, "active_size": active, "requested_size": requested,
            "stream": head.stream, "segment_type": "small" if head.pool.is_small else "large",
            "segment_pool_id": (0, 0), "is_expandable": head.expandable is not None,
            "frames": head.segment_context.frames if head.segment_context else [], "blocks": blocks,
        })
    return sorted(segments, key=lambda s: s["address"])


def settings_dict(settings: AllocatorSettings) -> dict[str, Any]:
    """`allocator_settings` as torch reports them (max_split_size -1 when unset)."""
    divisions = settings.roundup_power2_divisions
    return {
        "PYTORCH_CUDA_ALLOC_CONF": settings.conf_string(),
        "max_split_size": settings.max_split_size if settings.max_split_size is not None else -1,
        "garbage_collection_threshold": 0.0,
        "expandable_segments": settings.expandable_segments,
        "pinned_num_register_threads": 1,
        "release_lock_on_cudamalloc": False,
        "pinned_use_cuda_host_register": False,
        "graph_capture_record_stream_reuse": False,
        "roundup_power2_divisions": {k: int(divisions.get(k, 0)) for k in _ROUNDUP_KEYS},
    }


def snapshot_dict(allocator: CachingAllocator, annotations: list[dict[str, Any]]) -> dict[str, Any]:
    """The whole snapshot for one device: final segments, the trace, settings and annotation ranges."""
    return {
        "segments": segment_dicts(allocator),
        "device_traces": [allocator.trace],
        "allocator_settings": settings_dict(allocator.settings),
        "external_annotations": annotations,
    }


def write_snapshot(snapshot: dict[str, Any], path: Path) -> None:
    with open(path, "wb") as f:
        pickle.dump(snapshot, f, protocol=PICKLE_PROTOCOL)
