"""The out-of-memory verdict and the fragmentation finding at their boundaries, on hand-made snapshots.

- outside PyTorch: more than 10% of the device neither free nor reserved by PyTorch at the OOM
  (analyzer.diagnose.oom.OUTSIDE_THRESHOLD);
- fragmentation: the allocator's free cached memory would cover the request and is at least 5% of what it
  reserved (analyzer.diagnose.fragmentation.RECOVERY_THRESHOLD), at the OOM and at the reserved peak.
"""
from __future__ import annotations

import math

import pytest

import analyzer
from support.snapshots import GiB, MiB, Recording

OUTSIDE_THRESHOLD = 0.10
RECOVERY_THRESHOLD = 0.05


def _oom(analysis: analyzer.Analysis) -> dict:
    return next(f for f in analysis.devices[0].diagnosis.findings if f["kind"] == "oom")


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
    assert _oom(analysis)["evidence"]["details"]["outside_pytorch_bytes"] == outside
    return analysis


def test_ten_percent_of_the_device_outside_pytorch_is_still_a_capacity_oom():
    analysis = _oom_with_outside(LIMIT)
    d = analysis.devices[0].diagnosis
    assert _oom(analysis)["verdict"] == "capacity"
    assert d.triage["verdict"] == "steady_state" and "the work does not fit" in d.verdict


def test_a_byte_more_than_ten_percent_outside_pytorch_is_blamed_on_it():
    analysis = _oom_with_outside(LIMIT + 1)
    d = analysis.devices[0].diagnosis
    assert _oom(analysis)["verdict"] == "outside_pytorch"
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
    details = _oom(analysis)["evidence"]["details"]
    assert (details["reserved_bytes"], details["reserved_unallocated_bytes"]) == (ALLOCATED + cached, cached)
    assert details["largest_free_block_bytes"] < 8 * MiB
    return analysis


def test_free_cached_memory_of_5_percent_of_the_reserve_makes_a_fragmentation_oom():
    analysis = _oom_with_cached(CACHED_AT)
    d = analysis.devices[0].diagnosis
    assert _oom(analysis)["verdict"] == "fragmentation"
    assert d.remedies[0]["id"] == "expandable_segments" and d.remedies[0]["try_first"]


def test_a_byte_less_free_cached_memory_is_a_capacity_oom():
    analysis = _oom_with_cached(CACHED_AT - 1)
    d = analysis.devices[0].diagnosis
    assert _oom(analysis)["verdict"] == "capacity"
    assert "expandable_segments" not in {r["id"] for r in d.remedies}


# ---- RECOVERY_THRESHOLD at the reserved peak -------------------------------------------------------------------
@pytest.mark.parametrize(("unused", "reported"), [(CACHED_AT, True), (CACHED_AT - 1, False)], ids=["at", "below"])
def test_fragmentation_is_reported_from_5_percent_of_the_reserve_holding_no_tensor(unused, reported):
    rec = Recording()
    with rec.step(1), rec.phase("forward"):
        rec.alloc(ALLOCATED)
        rec.reserve(unused)        # the reserved peak: `unused` bytes of it hold no tensor
    d = analyzer.analyze(rec.trace()).devices[0]
    found = [f for f in d.diagnosis.findings if f["kind"] == "fragmentation"]
    assert d.diagnosis.fragmentation["reserved_bytes"] == ALLOCATED + unused
    assert d.diagnosis.fragmentation["inactive_bytes"] == unused
    assert [f["bytes"] for f in found] == ([unused] if reported else [])
