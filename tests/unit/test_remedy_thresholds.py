"""The remedy decisions at their boundaries: when a remedy's new peak fits the device, when a remedy is listed
at all, and which one is tried first when the device's size is unknown.

Each boundary is written here with its documented value (the docstrings of analyzer.diagnose.remedies), and
the inputs sit one byte either side of it: moving a threshold, or turning `<=` into `<`, fails a test.
"""
from __future__ import annotations

import math

import pytest

from analyzer.diagnose.remedies import Demand, describe, rank_remedies

GiB = 1 << 30
FIT_HEADROOM = 0.95     # remedies.FIT_HEADROOM: a new peak fits when it uses at most 95% of the device
RELEVANT_SHARE = 0.05   # remedies.RELEVANT_SHARE: a remedy acts on at least 5% of the peak to be listed
UNKNOWN_DEVICE_FIRST = 0.1  # without a capacity, the first remedy saving at least 10% of the peak is tried first
OPTIMIZER_REMEDIES = {"optimizer_8bit", "adafactor", "optimizer_offload", "zero1"}


def _by_id(demand: Demand) -> dict[str, dict]:
    return {r["id"]: r for r in rank_remedies(demand)}


# ---- FIT_HEADROOM ----------------------------------------------------------------------------------------------
CAPACITY = 80 * GiB
ACTIVATIONS = 16 * GiB   # halving the micro-batch saves half of them
LIMIT = FIT_HEADROOM * CAPACITY


def _halved_micro_batch(new_peak: int) -> dict:
    """Halve the micro-batch on a run whose new peak would be `new_peak` bytes (activations and parameters)."""
    total = new_peak + ACTIVATIONS // 2
    demand = Demand(total=total, by_category={"activation": ACTIVATIONS, "parameter": total - ACTIVATIONS},
                    capacity=CAPACITY, world_size=None, layers=None)
    remedy = _by_id(demand)["micro_batch"]
    assert remedy["new_peak_bytes"] == new_peak
    return remedy


def test_a_new_peak_at_95_percent_of_the_device_fits():
    remedy = _halved_micro_batch(math.floor(LIMIT))
    assert remedy["fits"] is True and remedy["try_first"] is True
    assert "fits in 80.00 GiB" in describe(remedy, CAPACITY)


def test_a_new_peak_one_byte_above_95_percent_does_not_fit():
    remedy = _halved_micro_batch(math.floor(LIMIT) + 1)
    assert remedy["fits"] is False and remedy["try_first"] is False
    assert "still above 80.00 GiB" in describe(remedy, CAPACITY)


@pytest.mark.parametrize(("total", "fits"), [(CAPACITY, True), (CAPACITY + 1, False)], ids=["at", "above"])
def test_an_allocator_setting_fits_when_the_allocated_peak_is_within_the_whole_device(total, fits):
    """Layout-only remedies keep the allocated peak: it must fit the device itself, with no headroom."""
    demand = Demand(total=total, by_category={"activation": total}, capacity=CAPACITY, world_size=None, layers=None,
                    oom_verdict="fragmentation", expandable_segments=False, recoverable_fragmentation=GiB)
    remedy = _by_id(demand)["expandable_segments"]
    assert remedy["new_peak_bytes"] == total
    assert remedy["fits"] is fits and remedy["try_first"] is fits and remedy["rank"] == 1


# ---- RELEVANT_SHARE --------------------------------------------------------------------------------------------
PEAK = 64 * GiB
AT_SHARE = math.ceil(RELEVANT_SHARE * PEAK)


def _listed_with_optimizer_state(state: int) -> set[str]:
    demand = Demand(total=PEAK, by_category={"optimizer_state": state, "other": PEAK - state}, capacity=None,
                    world_size=None, layers=None)
    return set(_by_id(demand))


def test_optimizer_remedies_are_listed_when_the_state_is_5_percent_of_the_peak():
    assert OPTIMIZER_REMEDIES <= _listed_with_optimizer_state(AT_SHARE)


def test_optimizer_remedies_are_left_out_one_byte_below_5_percent():
    assert not OPTIMIZER_REMEDIES & _listed_with_optimizer_state(AT_SHARE - 1)


def test_a_device_that_held_nothing_has_no_remedy():
    """muduard's dump_snapshot holds a cuda:0 whose peak is 0 B: 0 B is 5% of it, yet nothing acts on nothing."""
    empty = Demand(total=0, by_category={}, capacity=None, world_size=None, layers=None)
    assert _by_id(empty) == {}
    tiny = Demand(total=1024, by_category={"activation": 1024}, capacity=None, world_size=None, layers=None)
    assert "model_changes" in _by_id(tiny)


# ---- try first without a device size ---------------------------------------------------------------------------
@pytest.mark.parametrize(("saved", "first"), [(math.ceil(UNKNOWN_DEVICE_FIRST * PEAK), "micro_batch"),
                                              (math.ceil(UNKNOWN_DEVICE_FIRST * PEAK) - 1, None)],
                         ids=["at", "below"])
def test_without_a_capacity_the_first_remedy_saving_a_tenth_of_the_peak_is_tried_first(saved, first):
    """Every remedy for activations saves half of them here; with no device size none can be said to fit."""
    demand = Demand(total=PEAK, by_category={"activation": 2 * saved, "other": PEAK - 2 * saved}, capacity=None,
                    world_size=None, layers=None)
    remedies = rank_remedies(demand)
    assert remedies[0]["id"] == "micro_batch" and remedies[0]["saved_bytes"] == saved
    assert next((r["id"] for r in remedies if r["try_first"]), None) == first
