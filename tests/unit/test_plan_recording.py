"""The plan of `analyze FILE` (issue 21): a run no single remedy fits gets the cheapest combination, each
step's peak from the counterfactual replay of its composed transforms; a run that fits gets none. The verdict,
the remedy list and the plan name one try-first (plan.agree), the same in JSON, terminal, Markdown and HTML."""
from __future__ import annotations

import json
import math

import pytest
from markupsafe import escape
from rich.console import Console

from analyzer import pipeline
from analyzer.diagnose import plan
from analyzer.diagnose.remedies import FIT_HEADROOM, REMEDIES, Demand, rank_remedies
from analyzer.report.html import render_html
from analyzer.report.markdown import render_markdown
from analyzer.report.text import print_summary
from analyzer.report.view import build_view
from analyzer.result import Analysis
from support.paths import SIM
from support.snapshots import GiB, MiB, Recording

GPT = SIM / "gpt_activation_peak.pickle"
CAPACITY_OOM = SIM / "capacity_oom.pickle"


def _analysis(path, capacity: int, gpus: int | None = None):
    if not path.exists():
        pytest.skip(f"{path} is absent")
    return pipeline.analyze(str(path), gpu_memory=capacity, world_size=gpus)


def _device(capacity: int, gpus: int | None = 1):
    return _analysis(GPT, capacity, gpus).devices[0].diagnosis


def _first(dx) -> dict:
    (first,) = [r for r in dx.remedies if r["try_first"]]
    return first


def test_no_single_remedy_fits_six_gib_and_the_plan_replayed_does():
    """20.5 GiB of a GPT's backward on one 6 GiB GPU: the best single change (checkpointing) replays to 7.3 GiB;
    the plan is accumulation over 8 micro-batches, replayed, within 95% of the device and without an OOM."""
    dx = _device(6 * GiB)
    assert not any(r["fits"] for r in dx.remedies)
    found = dx.plan
    assert found["fits"] and found["steps"][-1]["fits"] and found["steps"][-1]["source"] == "replay"
    last = found["steps"][-1]
    assert last["predicted_peak_allocated_bytes"] <= FIT_HEADROOM * 6 * GiB
    assert last["predicted_peak_reserved_bytes"] <= 6 * GiB
    assert not any(s["fits"] for s in found["steps"][:-1])


def test_with_no_single_fit_the_try_first_is_the_plans_first_step_everywhere():
    """No single change fits: the remedy marked try-first is the plan's first step, says so (`plan_step`), and
    the verdict, the terminal, the Markdown, the HTML and the JSON all name that step."""
    analysis = _analysis(GPT, 6 * GiB, 1)
    dx = analysis.devices[0].diagnosis
    step = dx.plan["steps"][0]
    first = _first(dx)
    assert first["id"] == step["remedy"] == dx.plan["try_first"] and dx.plan["cheapest_single"] is None
    assert first["plan_step"] == f"the plan's step 1 of {len(dx.plan['steps'])}: {step['title']}"
    assert "Try first, as the plan below: " + step["title"] in dx.verdict and "no change as listed fits" in dx.verdict
    console = Console(record=True, width=400, force_terminal=False)
    print_summary(analysis, console)
    view = build_view(analysis)
    outputs = {"terminal": console.export_text(), "markdown": render_markdown(view, None),
               "html": render_html(analysis)}
    for name, text in outputs.items():
        assert (str(escape(first["plan_step"])) if name == "html" else first["plan_step"]) in text, name
    marked = [r for r in json.loads(analysis.to_json_text())["devices"][0]["remedies"] if r["try_first"]]
    assert [r["id"] for r in marked] == [step["remedy"]]


def test_when_the_cheapest_single_fit_is_the_plan_they_agree():
    """capacity_oom on its own 24 GiB: halving the micro-batch fits alone; the plan is that one change with the
    list's own prediction, and the verdict's try-first is it, with no plan step."""
    dx = _analysis(CAPACITY_OOM, 24 * GiB).devices[0].diagnosis
    first = _first(dx)
    assert first["fits"] and dx.plan["single"] and dx.plan["try_first"] == first["id"] == dx.plan["cheapest_single"]
    (step,) = dx.plan["steps"]
    assert step["remedy"] == first["id"] and step["predicted_peak_allocated_bytes"] == first["new_peak_bytes"]
    assert first["plan_step"] is None and f"Try first: {first['title']}" in dx.verdict


def test_a_cheaper_plan_than_the_cheapest_single_fit_leads():
    """Without --gpus, pipeline parallelism over the fewest stages that fit fits alone (the formula), but
    accumulation over 8 micro-batches (cost 5.25 against 8.5) replays to a fit: the plan leads, never dearer."""
    dx = _device(6 * GiB, gpus=None)
    single = next(r for r in dx.remedies if r["id"] == dx.plan["cheapest_single"])
    assert single["fits"] and single["id"] == "pipeline_parallel"
    steps = dx.plan["steps"]
    plan_cost = sum(plan.recording_cost(s["remedy"], False) * (s["value"].bit_length() - 1 if s["remedy"] in (
        "micro_batch", "gradient_accumulation") else 1) for s in steps)
    assert plan_cost <= plan.recording_cost(single["id"], False)
    assert _first(dx)["id"] == steps[0]["remedy"] != single["id"]
    assert f"cheaper than {single['title']} alone" in dx.verdict


def test_a_combination_where_each_alone_falls_short():
    """capacity_oom (23.7 GiB) on one 7 GiB GPU: halving the micro-batch replays to 12.26 GiB and checkpointing
    to 6.69 GiB (over 95% of 7 GiB); both, composed and replayed, fit: two steps, the first not yet fitting, and
    the verdict names both in order."""
    dx = _analysis(CAPACITY_OOM, 7 * GiB, 1).devices[0].diagnosis
    assert not any(r["fits"] for r in dx.remedies)
    steps = dx.plan["steps"]
    assert [s["remedy"] for s in steps] == ["micro_batch", "activation_checkpointing"]
    assert not steps[0]["fits"] and steps[-1]["fits"] and steps[-1]["source"] == "replay"
    assert steps[-1]["predicted_peak_allocated_bytes"] <= FIT_HEADROOM * 7 * GiB
    assert "Try first, as the plan below: " + ", then ".join(s["title"] for s in steps) in dx.verdict


def test_a_run_that_fits_gets_no_plan():
    assert _device(80 * GiB).plan is None


def test_the_lattice_costs_single_changes_in_the_remedy_lists_order():
    """The plan's one-change configurations rank as the remedy list does, so the cheapest single fit is the
    cheapest one-change plan (allocator settings first only at a fragmentation OOM, as in the list)."""
    for layout_first in (False, True):
        ids = [r.id for r in REMEDIES if r.id in plan.RECORDING_COST]
        listed = sorted(ids, key=lambda i: layout_first and i not in plan.LAYOUT_FIRST_COST)
        costs = [plan.recording_cost(i, layout_first) for i in listed]
        assert costs == sorted(costs) and len(set(costs)) == len(costs)


def _forward_only(capacity: int) -> Analysis:
    """A forward-only run: 6 GiB of weights loaded, then 6 GiB of activations alive at once."""
    rec = Recording()
    with rec.step(1):
        with rec.phase("load"):
            for i in range(6):
                rec.alloc(GiB, where=f"model.py:{10 + i}")
        with rec.phase("forward"):
            kept = [rec.alloc(512 * MiB, where="model.py:40") for _ in range(12)]
            for addr in kept:
                rec.free(addr)
    return pipeline.analyze(rec.trace(), gpu_memory=capacity, world_size=1)


def test_a_formula_change_composed_with_a_replay_that_alone_ran_out_still_fits():
    """On 5 GiB, halving the batch replays to an OOM (9 GiB: the 6 GiB of weights stay) and 4-bit weights alone
    (a formula) leave 7.5 GiB; together they fit: the replay's OOM, which ran without the formula's saving, does
    not refute the composition; its allocated peak less that saving is judged."""
    dx = _forward_only(5 * GiB).devices[0].diagnosis
    assert dx.workload.kind == "forward_only"
    assert not any(r["fits"] for r in dx.remedies)
    steps = dx.plan["steps"]
    assert [(s["remedy"], s["value"]) for s in steps] == [("micro_batch", 2), ("weight_quantization_4bit", None)]
    assert steps[-1]["fits"] and steps[-1]["predicted_peak_allocated_bytes"] <= FIT_HEADROOM * 5 * GiB
    assert steps[0]["source"] == "replay" and steps[-1]["source"] == "formula"


def test_parallel_degrees_never_take_more_gpus_than_the_job_has():
    """With 4 GPUs, ZeRO-3 over 4 with tensor parallelism over 4 would fit 16 GiB (11 GiB), but takes 16 GPUs:
    the plan combines no parallel degrees beyond the 4, and still finds one that fits."""
    demand = Demand(total=100 * GiB, by_category={"parameter": 25 * GiB, "gradient": 25 * GiB,
                                                  "optimizer_state": 25 * GiB, "activation": 25 * GiB},
                    capacity=16 * GiB, world_size=4, layers=None, oomed=True)
    levers = {lv.name: lv for lv in plan.recording_levers(demand, rank_remedies(demand))}
    zero3 = next(level for level in levers["zero"].levels if level.id == "zero3")
    assert (zero3.value, levers["tp"].levels[1].value) == (4, 4)
    assert plan.formula_peak(demand, {"zero": zero3, "tp": levers["tp"].levels[1]}) <= FIT_HEADROOM * 16 * GiB
    found = plan.for_recording(demand, rank_remedies(demand), None)
    assert found["fits"]
    degrees = [s["value"] for s in found["steps"] if s["remedy"] in ("zero1", "zero2", "zero3", "tensor_parallel",
                                                                      "pipeline_parallel")]
    assert degrees and math.prod(degrees) <= 4


def test_candidates_count_what_a_single_replay_found_beyond_its_formula():
    """adam_first_step (9.97 GiB, its optimizer step) on one 3 GiB GPU: optimizer offload replays to 3.99 GiB,
    2 GiB below its formula (the step's temporaries go with the state); with that, weight offload on top is a
    candidate, and the plan is the two of them (2.0 GiB), which the formula alone would not have tried."""
    path = SIM / "adam_first_step.pickle"
    dx = _analysis(path, 3 * GiB, 1).devices[0].diagnosis
    offload = next(r for r in dx.remedies if r["id"] == "optimizer_offload")
    assert offload["saving_source"] == "replay" and not offload["fits"]
    steps = dx.plan["steps"]
    assert [s["remedy"] for s in steps] == ["optimizer_offload", "offload"] and steps[-1]["fits"]
    assert steps[0]["predicted_peak_allocated_bytes"] == offload["new_peak_bytes"]
    assert steps[-1]["predicted_peak_allocated_bytes"] <= FIT_HEADROOM * 3 * GiB


def test_a_replayed_plan_wins_over_a_cheaper_combination_resting_on_a_formula():
    """oom_with_nccl (84 GiB, its backward) on one 42 GiB GPU: halving the micro-batch (replayed, 42 GiB) with
    bf16 (a formula, low confidence: a loose upper bound) would fit by 2.5 of cost; accumulation over 4
    micro-batches replays to 21 GiB at 3.5 and is the plan; the formula combination stays an alternative, said
    to be cheaper (extra cost -1)."""
    path = SIM.parent / "nsys" / "oom_with_nccl.pickle"
    dx = _analysis(path, 42 * GiB, 1).devices[0].diagnosis
    bf16 = next(r for r in dx.remedies if r["id"] == "bf16")
    assert bf16["saving_source"] == "formula" and bf16["confidence"] == "low"
    assert [(s["remedy"], s["value"], s["source"]) for s in dx.plan["steps"]] == [("gradient_accumulation", 4, "replay")]
    cheaper = dx.plan["alternatives"][0]
    assert cheaper["remedies"] == ["micro_batch", "bf16"] and cheaper["extra_cost"] == -1.0
    assert cheaper["predicted_peak_allocated_bytes"] <= FIT_HEADROOM * 42 * GiB
