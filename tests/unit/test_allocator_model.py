"""The allocator model against the C++ rules it mirrors, and against real recordings replayed through it."""
from __future__ import annotations

from collections import Counter

import pytest

from analyzer.core.allocator_rules import LARGE_BUFFER, SMALL_BUFFER
from analyzer.ingest.safe_pickle import load_untrusted
from analyzer.simulate.allocator import AllocatorSettings, CachingAllocator, SimulatedOutOfMemory
from analyzer.simulate.device import DeviceMemory
from analyzer.simulate.replay import replay
from analyzer.simulate.snapshot_writer import segment_dicts

MiB = 1 << 20


def _allocator(capacity: int | None = None, **settings) -> CachingAllocator:
    return CachingAllocator(DeviceMemory(capacity), AllocatorSettings(**settings))


def _actions(allocator: CachingAllocator, action: str) -> list[int]:
    return [e["size"] for e in allocator.trace if e["action"] == action]


def test_small_requests_share_a_2mib_segment_in_512_byte_blocks():
    a = _allocator()
    first, second = a.malloc(1), a.malloc(1000)
    assert (first.size, second.size) == (512, 1024)
    assert _actions(a, "segment_alloc") == [SMALL_BUFFER]
    assert second.addr == first.addr + 512


def test_segment_sizes_follow_the_request_size():
    a = _allocator()
    a.malloc(9 * MiB + 1)       # large pool, below 10 MiB: a 20 MiB segment, split
    a.malloc(12 * MiB + 3)      # 10 MiB and above: the request rounded up to 2 MiB
    assert _actions(a, "segment_alloc") == [LARGE_BUFFER, 14 * MiB]


@pytest.mark.parametrize("divisions, size", [({}, 1 * MiB + 200 * 1024 + 512), ({str(i): 4 for i in range(16)}, 1.25 * MiB)])
def test_roundup_power2_divisions_round_a_request_up_to_its_division(divisions, size):
    """PYTORCH_CUDA_ALLOC_CONF=roundup_power2_divisions:4 rounds 1.2 MiB up to the next quarter of its power of
    two, 1.25 MiB; without it, to 512 bytes. The second request of the size is rounded as the first was."""
    a = _allocator(roundup_power2_divisions=divisions)
    assert [a.malloc(1 * MiB + 200 * 1024 + 1).size for _ in range(2)] == [size, size]


def test_large_pool_keeps_remainders_only_above_1mib():
    a = _allocator()
    block = a.malloc(19 * MiB + 512)   # remainder 512 KiB - 512 B: not split, the whole segment is the block
    assert block.size == LARGE_BUFFER
    b = a.malloc(18 * MiB + 512)       # a 20 MiB segment again; remainder 2 MiB - 512 B > 1 MiB: split
    assert b.size == 18 * MiB + 512 and b.next is not None and b.next.size == 2 * MiB - 512


def test_free_merges_neighbours_and_best_fit_takes_the_smallest_block():
    a = _allocator()
    x, y = a.malloc(4 * MiB), a.malloc(4 * MiB)
    a.free(x)
    a.free(y)
    (segment,) = segment_dicts(a)
    assert [b["size"] for b in segment["blocks"]] == [LARGE_BUFFER]
    big = a.malloc(30 * MiB)
    a.free(big)
    assert a.malloc(3 * MiB).addr == segment["address"]  # the 20 MiB block fits better than the 30 MiB one


def test_blocks_are_cached_per_stream():
    a = _allocator()
    a.free(a.malloc(4 * MiB, stream=0))
    a.malloc(4 * MiB, stream=7)
    assert _actions(a, "segment_alloc") == [LARGE_BUFFER, LARGE_BUFFER]


def test_max_split_size_keeps_oversize_blocks_whole():
    a = _allocator(max_split_size=64 * MiB)
    a.free(a.malloc(100 * MiB))
    small = a.malloc(30 * MiB)        # below max_split_size: may not take the 100 MiB block
    assert small.size == 30 * MiB and len(_actions(a, "segment_alloc")) == 2
    assert a.malloc(90 * MiB).size == 100 * MiB   # within 20 MiB: takes the oversize block whole


def test_oom_releases_unsplit_cache_then_records_device_free_and_rounded_size():
    a = _allocator(capacity=100 * MiB)
    keep = a.malloc(5 * MiB)             # a split 20 MiB segment: cannot be released
    a.free(a.malloc(40 * MiB))           # an unsplit cached segment: released on the retry
    a.malloc(60 * MiB)                   # fits only after the release
    assert _actions(a, "segment_free") == [40 * MiB]
    with pytest.raises(SimulatedOutOfMemory) as raised:
        a.malloc(30 * MiB + 5)
    oom = a.trace[-1]
    assert oom["action"] == "oom" and "addr" not in oom
    assert oom["size"] == 30 * MiB + 512 and oom["device_free"] == 100 * MiB - 20 * MiB - 60 * MiB
    assert raised.value.alloc_size == 32 * MiB and keep.allocated


def test_expandable_segments_map_pages_and_unmap_them_under_pressure():
    a = _allocator(capacity=200 * MiB, expandable_segments=True)
    x = a.malloc(30 * MiB)
    y = a.malloc(30 * MiB)
    assert y.addr == x.addr + 30 * MiB                       # one growing segment
    assert sum(_actions(a, "segment_map")) == 60 * MiB     # 20 MiB pages, mapped on demand
    a.free(x)
    a.malloc(150 * MiB)                                      # needs the pages under x: unmapped, remapped
    assert _actions(a, "segment_unmap")
    assert not any(e["action"] in ("segment_alloc", "oom") for e in a.trace)


# ---- agreement with real recordings ------------------------------------------------------------------
# recordings whose history is complete (every alloc's segment was allocated in the trace, no free before its
# alloc) and that release no cache, so that the requests alone determine the allocator's decisions
COMPLETE = [
    "zidongliu-decomfl/memory.pickle",
    "silmont2000-cs336-a2/mem_snapshot.pickle",
    "shreyansh26-mlsys-experiments/profile_grad.pkl",
    "hugepanda-octree-nca/cuda_single_step.pickle",
    "constructor-sun-code_location/memory_snapshot.pickle",   # expandable segments, three devices
]


def _agreement(path) -> Counter:
    data = load_untrusted(open(path, "rb"), str(path))
    settings = AllocatorSettings(expandable_segments=bool(data["allocator_settings"]["expandable_segments"]))
    counts: Counter = Counter()
    for device, trace in enumerate(data["device_traces"]):
        if not any(e["action"] == "alloc" for e in trace):
            continue
        result = replay(trace, settings, same_addresses=True)
        grow = ("segment_alloc", "segment_map")
        real = [e["size"] for e in trace if e["action"] in grow]
        model = [e["size"] for e in result.allocator.trace if e["action"] in grow]
        counts["segments"] += max(len(real), len(model))
        counts["segments_equal"] += sum(r == m for r, m in zip(real, model, strict=True))
        final = {b["address"]: b for s in data["segments"] if s["device"] == device
                 for b in s["blocks"] if b["state"] == "active_allocated"}
        open_allocs = {}
        for i, e in enumerate(trace):
            if e["action"] == "alloc":
                open_allocs[e["addr"]] = i
            elif e["action"] in ("free_requested", "free_completed"):
                open_allocs.pop(e["addr"], None)
        for addr, i in open_allocs.items():
            block = final.get(addr)
            if block is not None and block["requested_size"] == trace[i]["size"]:
                counts["blocks"] += 1
                counts["blocks_equal"] += result.blocks[i].size == block["size"]
        if not settings.expandable_segments:   # same addresses: the model must put every tensor where torch did
            real_addrs = [e["addr"] for e in trace if e["action"] == "alloc"]
            model_addrs = [e["addr"] for e in result.allocator.trace if e["action"] == "alloc"]
            counts["placements"] += len(real_addrs)
            counts["placements_equal"] += sum(r == m for r, m in zip(real_addrs, model_addrs, strict=True))
    return counts


def test_model_agrees_with_the_real_allocator(real_dir):
    total: Counter = Counter()
    for name in COMPLETE:
        counts = _agreement(real_dir / name)
        print(f"{name}: " + ", ".join(f"{k} {counts[k + '_equal']}/{counts[k]}" for k in ("segments", "blocks", "placements")))
        total += counts
    rates = {k: total[k + "_equal"] / total[k] for k in ("segments", "blocks", "placements")}
    print("agreement:", {k: f"{v:.2%} of {total[k]}" for k, v in rates.items()})
    assert total["segments"] >= 300 and total["blocks"] >= 1000 and total["placements"] >= 7900
    assert rates["segments"] == 1.0 and rates["blocks"] == 1.0 and rates["placements"] == 1.0
