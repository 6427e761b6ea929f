"""The gate's decisions at their boundaries, on hand-made peak summaries (analyzer.gate.compare).

A device holds a budget when the memory it needed is at most the budget; a baseline when it is at most
int(baseline × (1 + tolerance)), the tolerance 5% by default (Megatron-LM's rtol for mem-max-allocated-bytes);
it is stale below baseline × (1 − tolerance). The cheapest fix is the plan when made for this very budget, else
the first remedy in list order whose predicted peak is at most FIT_HEADROOM = 95% of the budget, allocator
settings never. A likely change: parameters or inputs grown by GREW = 1% or more; a site grown by at least
(inputs ratio) ** 1.5 is a longer sequence.
"""
from __future__ import annotations

import math
from dataclasses import replace

import pytest

from analyzer.gate.compare import Cause, cheapest_fix, check_baseline, check_budget
from analyzer.gate.summary import DevicePeak, Kind, Option, Plan, RunPeaks, Site, StepPeak

GiB = 2**30
TOLERANCE = 0.05
FIT_HEADROOM = 0.95
GREW = 0.01
SQUARE_EXPONENT = 1.5


def device(needed: int = 10 * GiB, **kw: object) -> DevicePeak:
    base = dict(device=0, rank=None, needed_bytes=needed, peak_bytes=needed, reserved_bytes=None, oom=False, step=2,
                phase="backward", module=None,
                by_category={"activation": needed - 4 * GiB, "parameter": 2 * GiB, "optimizer_state": 2 * GiB},
                by_phase={"forward": needed - 4 * GiB, "load": 2 * GiB, "optimizer": 2 * GiB},
                by_module={"layers.0": needed - 4 * GiB, "(root module)": 4 * GiB})
    base.update(kw)
    return DevicePeak(**base)  # type: ignore[arg-type]


def run(*devices: DevicePeak) -> RunPeaks:
    return RunPeaks("run.pickle", Kind.RECORDING, devices)


def test_budget_holds_at_the_budget_and_fails_one_byte_under():
    d = device(needed=10 * GiB)
    assert check_budget(run(d), 10 * GiB).holds
    failed = check_budget(run(d), 10 * GiB - 1)
    assert not failed.holds and failed.exit_code == 1
    assert failed.devices[0].over_bytes == 1


def test_budget_failure_says_what_the_peak_is_made_of_largest_first():
    d = device(needed=10 * GiB)
    c = check_budget(run(d), 8 * GiB).devices[0]
    assert [(x.name, x.after) for x in c.categories] == [("activation", 6 * GiB), ("parameter", 2 * GiB),
                                                         ("optimizer_state", 2 * GiB)]
    assert all(x.before is None for x in c.categories)


def test_tolerance_limit_holds_at_it_and_fails_one_byte_past():
    then = device(needed=10 * GiB)
    limit = int(10 * GiB * (1 + TOLERANCE))
    assert check_baseline(run(device(needed=limit)), run(then)).holds
    assert not check_baseline(run(device(needed=limit + 1)), run(then)).holds
    assert check_baseline(run(device(needed=limit + 1)), run(then), tolerance=0.10).holds


def test_a_run_that_needs_less_holds_and_is_stale_past_the_tolerance():
    then = device(needed=10 * GiB)
    at = 10 * GiB * (1 - TOLERANCE)
    kept = check_baseline(run(device(needed=int(at))), run(then)).devices[0]
    assert kept.holds and not kept.stale
    stale = check_baseline(run(device(needed=int(at) - 1)), run(then)).devices[0]
    assert stale.holds and stale.stale


def test_what_grew_most_comes_first_and_new_names_are_new():
    then = device(needed=10 * GiB)
    now = device(needed=12 * GiB, by_category={"activation": 8 * GiB, "parameter": 2 * GiB,
                                                "optimizer_state": 2 * GiB},
                 by_module={"layers.0": 6 * GiB, "(root module)": 4 * GiB, "layers.1": 2 * GiB},
                 sites=(Site("model.py:40 forward", 3 * GiB, 4),), steps=())
    c = check_baseline(run(now), run(replace(then, sites=(Site("model.py:40 forward", GiB, 4),)))).devices[0]
    assert [(x.name, x.delta) for x in c.categories] == [("activation", 2 * GiB)]
    assert [(x.name, x.new) for x in c.modules] == [("layers.1", True)]
    assert [(x.name, x.before, x.after) for x in c.sites] == [("model.py:40 forward", GiB, 3 * GiB)]


def test_first_step_past_the_baseline_compares_running_peaks_step_by_step():
    then = device(steps=(StepPeak(1, 8 * GiB), StepPeak(2, 10 * GiB), StepPeak(3, 9 * GiB)))
    # step 3 of the run is past the baseline's running peak (10 GiB) by more than 5%; step 2 is within it
    now = device(needed=11 * GiB, steps=(StepPeak(1, 8 * GiB), StepPeak(2, int(10 * GiB * 1.05)),
                                         StepPeak(3, 11 * GiB)))
    c = check_baseline(run(now), run(then)).devices[0]
    assert c.first_step_over == StepPeak(3, 11 * GiB) and c.baseline_at_step == 10 * GiB


def test_first_step_past_a_budget():
    d = device(needed=10 * GiB, steps=(StepPeak(0, 2 * GiB), StepPeak(1, 8 * GiB), StepPeak(2, 10 * GiB)))
    assert check_budget(run(d), 8 * GiB).devices[0].first_step_over == StepPeak(2, 10 * GiB)
    assert check_budget(run(d), 8 * GiB - 1).devices[0].first_step_over == StepPeak(1, 8 * GiB)


def test_the_fix_is_the_plan_made_for_this_budget():
    plan = Plan(8 * GiB, (Option("micro_batch", "Halve the batch", 9 * GiB), Option("bf16", "bf16", 7 * GiB)))
    d = device(remedies=(Option("zero3", "ZeRO-3", 6 * GiB),), plan=plan)
    fix = cheapest_fix(d, 8 * GiB)
    assert fix is not None and fix.source == "plan" and [s.id for s in fix.steps] == ["micro_batch", "bf16"]
    assert fix.predicted_bytes == 7 * GiB
    other = cheapest_fix(d, 9 * GiB)   # the plan was made for 8 GiB: the list decides for 9
    assert other is not None and other.source == "remedy" and other.steps[0].id == "zero3"


def test_a_remedy_fixes_within_fit_headroom_of_the_budget_and_settings_never_do():
    budget = 10 * GiB
    at = int(FIT_HEADROOM * budget)
    d = device(needed=12 * GiB, remedies=(Option("expandable_segments", "expandable segments", 1),
                                          Option("micro_batch", "Halve the batch", at + 1),
                                          Option("bf16", "bf16", at)))
    fix = cheapest_fix(d, budget)
    assert fix is not None and fix.steps[0].id == "bf16"
    assert cheapest_fix(replace(d, remedies=d.remedies[:2]), budget) is None


def test_devices_pair_by_rank_and_device_and_a_lone_pair_pairs_whatever_its_index():
    assert check_baseline(run(device(device=1)), run(device(device=0))).devices[0].then is not None
    two = check_baseline(run(device(device=0), device(device=2)), run(device(device=0), device(device=1)))
    assert [d.then is not None for d in two.devices] == [True, False]
    assert two.holds
    assert any("cuda:2 has no baseline" in w for w in two.warnings)
    assert any("cuda:1 is in the baseline but not in the run" in w for w in two.warnings)


@pytest.mark.parametrize("grown, named", [(1 + GREW, True), (1 + GREW - 1e-4, False)])
def test_a_larger_model_is_named_from_parameters_grown_by_grew(grown, named):
    then = device()
    parameters = math.ceil(2 * GiB * grown)
    now = device(by_category={**then.by_category, "parameter": parameters},
                 by_module={**then.by_module, "layers.7": GiB})
    likely = check_baseline(run(now), run(then)).devices[0].likely
    assert (Cause.MODEL in [x.cause for x in likely]) is named
    if named:
        assert likely[0].evidence == ("layers.7",)


def _inputs(ratio: float, site_ratio: float) -> tuple[DevicePeak, DevicePeak]:
    then = device(by_category={"activation": 6 * GiB, "input": GiB}, sites=(Site("attn.py:9 forward", GiB, 1),))
    now = device(by_category={"activation": 6 * GiB, "input": math.ceil(GiB * ratio)},
                 sites=(Site("attn.py:9 forward", math.ceil(GiB * site_ratio), 1),))
    return now, then


@pytest.mark.parametrize("site_ratio, cause", [(2 ** SQUARE_EXPONENT, Cause.SEQUENCE),
                                               (2 ** SQUARE_EXPONENT - 0.01, Cause.INPUTS)])
def test_a_site_grown_as_the_square_of_the_inputs_is_a_longer_sequence(site_ratio, cause):
    now, then = _inputs(2.0, site_ratio)
    likely = check_baseline(run(now), run(then)).devices[0].likely
    assert [x.cause for x in likely] == [cause]


@pytest.mark.parametrize("ratio, named", [(1 + GREW, True), (1 + GREW - 1e-4, False)])
def test_inputs_grown_by_grew_are_a_larger_batch(ratio, named):
    now, then = _inputs(ratio, ratio)
    likely = check_baseline(run(now), run(then)).devices[0].likely
    assert [x.cause for x in likely] == ([Cause.INPUTS] if named else [])


def test_a_new_leak_finding_is_the_likely_change():
    now, then = device(findings=("leak",)), device()
    c = check_baseline(run(now), run(then)).devices[0]
    assert [x.cause for x in c.likely] == [Cause.LEAK] and c.new_findings == ("leak",)
    assert check_baseline(run(now), run(now)).devices[0].likely == ()
