"""The leak decision at its boundaries, on hand-made recordings of a few training steps.

A group of allocations (one user line) leaks when it keeps memory in enough measured steps (at least
step_levels.MIN_MEASURED_STEPS = 2 of them and at least half), the step-start levels grow by at least
leak.LEVEL_AGREEMENT = half of its rate, and the rate is at least leak.MIN_SHARE_OF_PEAK = 0.1% of the largest
step peak. The first and the last recorded steps are never measured.
Sizes of tensors sit one allocator block (512 bytes) either side of a boundary, the closest they can get.
"""
from __future__ import annotations

import math

import pytest

import analyzer
from support.snapshots import BLOCK, MiB, Recording

LEVEL_AGREEMENT = 0.5
MIN_SHARE_OF_PEAK = 0.001
MIN_MEASURED_STEPS = 2
KEPT = 4 * MiB   # what the leaking line keeps each step


def recording(steps: int = 6, kept_in: set[int] | None = None, given_back: int = 0, peak: int | None = None) -> Recording:
    """64 MiB of weights, then `steps` steps, each making and freeing an 8 MiB activation. Every measured step
    (2 .. steps-1, or those in `kept_in`) keeps KEPT bytes made at train.py:88; step 1 also makes one buffer of
    `given_back` bytes per measured step, one of which each measured step frees (memory given back at the step
    starts, offsetting the growth); step 3 raises the step peak to `peak` with a transient allocation."""
    kept_in = set(range(2, steps)) if kept_in is None else kept_in
    rec = Recording()
    rec.alloc(64 * MiB, "model.py:3")
    with rec.step(1), rec.phase("forward"):
        x = rec.alloc(8 * MiB, "model.py:5")
        buffers = [rec.alloc(given_back, "data.py:7") for _ in range(steps - 2)] if given_back else []
        rec.free(x, release=True)
    for step in range(2, steps + 1):
        with rec.step(step), rec.phase("forward"):
            x = rec.alloc(8 * MiB, "model.py:5")
            if step in kept_in:
                rec.alloc(KEPT, "train.py:88")
            if buffers and step < steps:
                rec.free(buffers.pop(), release=True)
            if peak is not None and step == 3:
                rec.free(rec.alloc(peak - rec.allocated, "model.py:9"), release=True)
            rec.free(x, release=True)
    return rec


def diagnosis(rec: Recording):
    return analyzer.analyze(rec.trace()).devices[0].diagnosis


def leaks(rec: Recording) -> list[dict]:
    return [f for f in diagnosis(rec).findings if f.kind == "leak"]


# ---- LEVEL_AGREEMENT -------------------------------------------------------------------------------------------
GIVEN_BACK_AT = math.floor((1 - LEVEL_AGREEMENT) * KEPT)   # the step starts grow by exactly half the rate


def test_a_leak_whose_step_starts_grow_by_half_its_rate_is_reported():
    d = diagnosis(recording(given_back=GIVEN_BACK_AT))
    (leak,) = [f for f in d.findings if f.kind == "leak"]
    assert leak.bytes_per_step == KEPT
    assert leak.evidence.details.level_growth_per_step == KEPT - GIVEN_BACK_AT
    assert d.triage["verdict"] == "leak" and d.remedies[0]["id"] == "fix_leak"


def test_kept_memory_offset_by_frees_so_the_step_starts_grow_by_less_than_half_is_no_leak():
    d = diagnosis(recording(given_back=GIVEN_BACK_AT + BLOCK))
    assert not [f for f in d.findings if f.kind == "leak"]
    assert d.triage["verdict"] == "steady_state"


# ---- MIN_SHARE_OF_PEAK -----------------------------------------------------------------------------------------
PEAK_AT = math.floor(KEPT / MIN_SHARE_OF_PEAK)    # the rate is exactly 0.1% of this step peak


@pytest.mark.parametrize(("peak", "found"), [(PEAK_AT, True), (PEAK_AT + BLOCK, False)], ids=["at", "above"])
def test_a_rate_below_a_thousandth_of_the_largest_step_peak_is_noise(peak, found):
    assert MIN_SHARE_OF_PEAK * PEAK_AT <= KEPT < MIN_SHARE_OF_PEAK * (PEAK_AT + BLOCK)
    got = leaks(recording(peak=peak))
    assert [f.evidence.details.largest_step_peak_bytes for f in got] == ([peak] if found else [])


# ---- MIN_MEASURED_STEPS ----------------------------------------------------------------------------------------
def test_two_measured_steps_give_a_rate():
    (leak,) = leaks(recording(steps=MIN_MEASURED_STEPS + 2))
    assert leak.evidence.details.measured_steps == [2, 3]


def test_one_measured_step_is_an_event_not_a_rate():
    d = diagnosis(recording(steps=MIN_MEASURED_STEPS + 1))
    assert not [f for f in d.findings if f.kind == "leak"]
    assert "growth across steps cannot be measured (3 training steps recorded; 4 or more are needed)" \
        in d.triage["reason"]


@pytest.mark.parametrize(("kept_in", "found"), [({2, 4, 6}, True), ({2, 5}, False)], ids=["half", "fewer"])
def test_a_line_leaks_when_it_keeps_memory_in_half_the_measured_steps(kept_in, found):
    """Eight steps recorded, six measured (2-7): three of them are enough, two are not (though two would be
    for MIN_MEASURED_STEPS alone)."""
    assert bool(leaks(recording(steps=8, kept_in=kept_in))) is found
