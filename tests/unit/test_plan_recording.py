"""The plan of `analyze FILE` (issue 21): a run no single remedy fits gets the cheapest combination, each
step's peak from the counterfactual replay of its composed transforms; a run that fits gets none."""
from __future__ import annotations

import pytest

from analyzer import pipeline
from support.paths import SIM

GiB = 2**30
GPT = SIM / "gpt_activation_peak.pickle"


def _device(capacity: int):
    if not GPT.exists():
        pytest.skip(f"{GPT} is absent")
    return pipeline.analyze(str(GPT), gpu_memory=capacity).devices[0].diagnosis


def test_no_single_remedy_fits_six_gib_and_the_plan_replayed_does():
    """20.5 GiB of a GPT's backward on 6 GiB: the best single change (checkpointing) replays to 7.3 GiB; the
    plan is accumulation over 8 micro-batches, replayed, within 95% of the device and without an OOM."""
    dx = _device(6 * GiB)
    assert not any(r["fits"] for r in dx.remedies)
    plan = dx.plan
    assert plan["fits"] and plan["steps"][-1]["fits"] and plan["steps"][-1]["source"] == "replay"
    last = plan["steps"][-1]
    assert last["predicted_peak_allocated_bytes"] <= 0.95 * 6 * GiB
    assert last["predicted_peak_reserved_bytes"] <= 6 * GiB
    assert not any(s["fits"] for s in plan["steps"][:-1])


def test_a_combination_where_each_alone_falls_short():
    """On 12 GiB accumulation alone replays to an OOM (its reserve is over the device); with expandable
    segments first it fits: two steps, the first not yet fitting, and the verdict names both."""
    dx = _device(12 * GiB)
    single = {r["id"]: r for r in dx.remedies}
    assert single["gradient_accumulation"]["fits"] is False
    steps = dx.plan["steps"]
    assert [s["remedy"] for s in steps][-1] == "gradient_accumulation" and steps[-1]["fits"]
    assert len(steps) >= 2 and not steps[0]["fits"]


def test_a_run_that_fits_gets_no_plan():
    assert _device(80 * GiB).plan is None
