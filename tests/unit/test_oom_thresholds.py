"""The out-of-memory verdict and the fragmentation finding at their boundaries, on hand-made snapshots.

- outside PyTorch: more than 10% of the device neither free nor reserved by PyTorch at the OOM
  (analyzer.diagnose.oom.OUTSIDE_THRESHOLD);
- fragmentation: the allocator's free cached memory would cover the request and is at least 5% of what it
  reserved (analyzer.diagnose.fragmentation.RECOVERY_THRESHOLD), at the OOM; at the peak, free pieces inside
  used segments of at least 5% of the reserve while the reserve is at least 95% of the device
  (NEAR_OOM_SHARE); whole free segments are cache, never fragmentation.
"""
from __future__ import annotations

import math

import pytest

import analyzer
from analyzer.result import OomFinding
from support.snapshots import GiB, MiB, Recording

OUTSIDE_THRESHOLD = 0.10
RECOVERY_THRESHOLD = 0.05


def _oom(analysis: analyzer.Analysis) -> OomFinding:
    return next(f for f in analysis.devices[0].diagnosis.findings if f.kind == "oom")


# ---- OUTSIDE_THRESHOLD -----------------------------------------------------------------------------------------
DEVICE = 1 * GiB
LIMIT = math.floor(OUTSIDE_THRESHOLD * DEVICE)


def _oom_with_outside(outside: int) -> analyzer.Analysis:
    """256 MiB reserved and allocated in the forward pass, no cached memory, then a request larger than what the
    device has free, with `outside` bytes of the device neither free nor PyTorch's."""
    rec = Recording()
    with rec.step(1), rec.phase("forward"):
        rec.alloc(256 * MiB)
        free = DEVICE - rec.reserved - outside
        rec.oom(free + 64 * MiB, device_free=free)
    analysis = analyzer.analyze(rec.trace(), gpu_memory=DEVICE)
    assert _oom(analysis).evidence.details.outside_pytorch_bytes == outside
    return analysis


def test_ten_percent_of_the_device_outside_pytorch_is_still_a_capacity_oom():
    analysis = _oom_with_outside(LIMIT)
    d = analysis.devices[0].diagnosis
    assert _oom(analysis).verdict == "capacity"
    assert d.triage["verdict"] == "steady_state" and "the work does not fit" in d.verdict


def test_a_byte_more_than_ten_percent_outside_pytorch_is_blamed_on_it():
    analysis = _oom_with_outside(LIMIT + 1)
    d = analysis.devices[0].diagnosis
    assert _oom(analysis).verdict == "outside_pytorch"
    assert d.triage["verdict"] == "outside_pytorch" and "memory outside PyTorch" in d.verdict


# ---- RECOVERY_THRESHOLD at the OOM -----------------------------------------------------------------------------
ALLOCATED = 180 * MiB


def least_share(share: float, rest: int) -> int:
    """The fewest bytes c that are at least `share` of rest + c."""
    c = math.ceil(share * rest / (1 - share))
    while c < share * (rest + c):
        c += 1
    while c > 0 and c - 1 >= share * (rest + c - 1):
        c -= 1
    return c


CACHED_AT = least_share(RECOVERY_THRESHOLD, ALLOCATED)


def _oom_with_cached(cached: int) -> analyzer.Analysis:
    """180 MiB allocated in the forward pass, `cached` bytes free in two empty cached segments (each smaller than
    the 8 MiB request, together enough with the 4 MiB free on the device), then the OOM."""
    rec = Recording()
    with rec.step(1), rec.phase("forward"):
        rec.alloc(ALLOCATED)
        rec.reserve(cached // 2)
        rec.reserve(cached - cached // 2)
        rec.oom(8 * MiB, device_free=4 * MiB)
    analysis = analyzer.analyze(rec.trace())
    details = _oom(analysis).evidence.details
    assert (details.reserved_bytes, details.reserved_unallocated_bytes) == (ALLOCATED + cached, cached)
    assert details.largest_free_block_bytes < 8 * MiB
    return analysis


def test_free_cached_memory_of_5_percent_of_the_reserve_makes_a_fragmentation_oom():
    analysis = _oom_with_cached(CACHED_AT)
    d = analysis.devices[0].diagnosis
    assert _oom(analysis).verdict == "fragmentation"
    # listed first; whether it is tried first is the replay's call: on this 194 MiB device, expandable segments
    # map the large pool in 20 MiB granules (200 MiB), so the replay says it still runs out (the fragmentation
    # fixture, on a realistic device, has it as try-first: tests/e2e/test_diagnosis.py)
    assert d.remedies[0]["id"] == "expandable_segments" and d.remedies[0]["replay"]["peak_reserved_bytes"] == 200 * MiB


def test_a_byte_less_free_cached_memory_is_a_capacity_oom():
    analysis = _oom_with_cached(CACHED_AT - 1)
    d = analysis.devices[0].diagnosis
    assert _oom(analysis).verdict == "capacity"
    assert "expandable_segments" not in {r["id"] for r in d.remedies}


# ---- fragmentation at the peak: warned only when it nearly caused an OOM ---------------------------------------
NEAR_OOM_SHARE = 0.95
PIECE = 16 * MiB   # a freed tensor in a used segment: a free piece, not cache


def _peak_with_piece(cache: int) -> Recording:
    """ALLOCATED + PIECE bytes alive in the forward pass, a PIECE free beside a live one in a used segment
    (fragmentation) and `cache` bytes of wholly free segments (cache)."""
    rec = Recording()
    with rec.step(1), rec.phase("forward"):
        if cache:
            rec.reserve(cache)
        rec.alloc(PIECE, segment=rec.reserve(2 * PIECE))
        rec.alloc(ALLOCATED)
    return rec


def _near_capacity(reserved: int) -> int:
    """The largest device memory under which `reserved` is at least NEAR_OOM_SHARE of it."""
    return math.floor(reserved / NEAR_OOM_SHARE)


@pytest.mark.parametrize(("extra", "warned"), [(0, True), (1, False)], ids=["at", "above"])
def test_fragmentation_at_the_peak_is_a_warning_from_95_percent_of_the_device_reserved(extra, warned):
    rec = _peak_with_piece(0)
    reserved = ALLOCATED + 2 * PIECE
    d = analyzer.analyze(rec.trace(), gpu_memory=_near_capacity(reserved) + extra).devices[0]
    picture = d.diagnosis.fragmentation
    assert (picture.reserved_bytes, picture.external_bytes, picture.cached_free_segments_bytes) == \
        (reserved, PIECE, 0)
    found = [f for f in d.diagnosis.findings if f.kind == "fragmentation"]
    assert [f.bytes for f in found] == ([PIECE] if warned else [])
    assert ("expandable_segments" in {r["id"] for r in d.diagnosis.remedies}) == warned


def test_cache_is_not_fragmentation_however_much_of_the_device_it_reserves():
    """Whole free segments are released and retried before an OOM: at 99% of the device reserved, a cache of
    ten times the free piece is reported as cache and warns of nothing when the piece is under 5% of the reserve."""
    rec = _peak_with_piece(10 * PIECE)
    reserved = ALLOCATED + 12 * PIECE
    assert PIECE < RECOVERY_THRESHOLD * reserved
    d = analyzer.analyze(rec.trace(), gpu_memory=math.floor(reserved / 0.99)).devices[0]
    picture = d.diagnosis.fragmentation
    assert (picture.external_bytes, picture.cached_free_segments_bytes) == (PIECE, 10 * PIECE)
    assert not [f for f in d.diagnosis.findings if f.kind == "fragmentation"]


def test_the_picture_is_the_allocated_peak_not_the_reserved_peak():
    """Cache reserved before the work (and given back) does not count at the peak."""
    rec = Recording()
    with rec.step(1), rec.phase("forward"):
        early = rec.reserve(4 * ALLOCATED)
        rec.release(early)
        rec.alloc(ALLOCATED)
    d = analyzer.analyze(rec.trace()).devices[0]
    assert d.diagnosis.fragmentation.event_index == d.peak.event_index
    assert d.diagnosis.fragmentation.reserved_bytes == ALLOCATED
