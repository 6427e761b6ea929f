"""Every registered remedy has every part, and each part reaches the place that uses it: the remedy list, the
plan (its lever, cost, formula and price), the replay, `analyze estimate`, the run log's pairing and the docs
table all iterate analyzer.diagnose.remedies.REMEDIES (the run log's pairing reads RemedyId.variables, which the spec
reads too). Adding a remedy is one spec: these tests then cover it."""
from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path

import pytest

from analyzer.core.vocabulary import Category, RemedyId
from analyzer.diagnose import counterfactual, plan
from analyzer.diagnose.remedies import BY_ID, REMEDIES, Breakdown, Demand, Remedy, rank_remedies
from analyzer.diagnose.theory import OPTIMIZERS
from analyzer.report.run_pairs import VARIABLE_REMEDIES

GiB = 1 << 30
ROOT = Path(__file__).resolve().parents[2]
PARTS = [f.name for f in dataclasses.fields(Remedy) if f.default is dataclasses.MISSING]


def test_every_remedy_id_has_exactly_one_spec():
    assert [r.id for r in REMEDIES] == list(dict.fromkeys(r.id for r in REMEDIES))
    assert set(BY_ID) == set(RemedyId)


def test_a_spec_cannot_leave_out_a_part():
    """Each part is a required keyword: a spec that forgets one (its plan lever, its docs) does not import."""
    assert {"acts_on", "price", "plan", "replay", "estimate_term", "docs"} <= set(PARTS)
    given = {name: getattr(BY_ID[RemedyId.MICRO_BATCH], name) for name in PARTS if name != "plan"}
    with pytest.raises(TypeError, match="plan"):
        Remedy(**given)


@pytest.mark.parametrize("remedy", REMEDIES, ids=lambda r: r.id.value)
def test_each_part_is_there_and_coherent(remedy: Remedy):
    assert remedy.title and remedy.how and remedy.cost and remedy.docs.strip()
    assert all(c in Category.__members__.values() for c in remedy.acts_on)
    if remedy.plan is not None or remedy.estimate_term is not None:
        assert remedy.price is not None and remedy.price.throughput and remedy.price.code   # the plan prices it
    if remedy.plan is not None:
        # a change of the allocated peak has a formula; a change of the layout alone has none
        assert (remedy.plan.formula is None) == remedy.layout_only
        assert remedy.id in plan.RECORDING_COST
    if remedy.layout_only:
        assert not remedy.acts_on   # it frees reserved memory, no category shrinks
    if remedy.replay is not None:
        assert counterfactual.transform_for(remedy.id, None, {remedy.id: 4}) is not None
    else:
        assert counterfactual.transform_for(remedy.id, None, {remedy.id: 4}) is None


def test_the_plan_has_a_lever_for_every_planned_remedy_in_the_registrys_order():
    planned = [r.id for r in REMEDIES if r.plan is not None]
    in_levers = [remedy for _, ids in plan._LEVERS for remedy in ids]
    assert sorted(in_levers) == sorted(planned)
    for _, ids in plan._LEVERS:   # inside a lever, the list's order
        assert list(ids) == [r for r in planned if r in ids]


def test_a_planned_remedy_the_list_offers_is_a_level_of_the_plan():
    """The plan's levers are made from the offered remedies: each planned remedy offered with a new peak is a level."""
    d = Demand(total=30 * GiB, by_category={"parameter": 4 * GiB, "gradient": 4 * GiB, "optimizer_state": 8 * GiB,
                                            "activation": 12 * GiB, "temporary": 2 * GiB},
               capacity=24 * GiB, world_size=8, layers=12, oomed=True, mixed_precision=False)
    offered = rank_remedies(d)
    levels = {level.id for lv in plan.recording_levers(d, offered) for level in lv.levels[1:]}
    planned_offered = {r["id"] for r in offered if BY_ID[r["id"]].plan is not None and r["new_peak_bytes"] is not None}
    assert planned_offered and planned_offered == levels


def test_the_estimate_command_offers_every_remedy_with_an_estimate_term():
    from analyzer.commands.estimate import plan as estimate_plan

    found = estimate_plan(70e9, 64, 0, 1.0, None, False)   # nothing fits 1 byte: every lattice level is searched
    assert not found["fits"]
    terms = {r.id for r in REMEDIES if r.estimate_term is not None}
    assert set(plan.COST) == terms
    optimizers = {r.id: r.estimate_term.optimizer for r in REMEDIES
                  if r.estimate_term is not None and r.estimate_term.optimizer is not None}
    assert set(optimizers.values()) <= set(OPTIMIZERS)


def test_8bit_adam_keeps_a_quarter_of_the_moments_in_its_estimate_formula_and_replay():
    """One number: a byte of Adam's four per moment (theory.OPTIMIZERS' adam_8bit keeps 1 byte a value)."""
    assert OPTIMIZERS["adam_8bit"][1] / 4 == 0.25
    d = Demand(total=20 * GiB, by_category={"optimizer_state": 12 * GiB, "activation": 8 * GiB}, capacity=None,
               world_size=1, layers=None, mixed_precision=False)
    saved, _ = BY_ID[RemedyId.OPTIMIZER_8BIT].estimate(d)
    assert saved == 9 * GiB                                         # 75% of fp32 Adam's moments
    planned = BY_ID[RemedyId.OPTIMIZER_8BIT].plan
    assert planned is not None and planned.formula is not None
    b = Breakdown(d.by_category, d.total)
    planned.formula(d, b, 1)
    assert b.total == 11 * GiB                                      # the same saving, composed by the plan


@pytest.mark.parametrize("remedy", [r for r in REMEDIES if r.plan is not None and r.plan.formula is not None],
                         ids=lambda r: r.id.value)
def test_the_plans_formula_saves_what_the_lists_estimate_says(remedy: Remedy):
    """One formula: alone, at the level the list's entry is at, the plan's formula saves the list's estimate
    (to a byte: the list rounds down, the plan to the nearest), on a run where every category is present."""
    d = Demand(total=64 * GiB + 3, by_category={"parameter": 8 * GiB, "gradient": 8 * GiB, "optimizer_state": 16 * GiB,
                                                "activation": 24 * GiB + 3, "input": GiB, "temporary": 4 * GiB,
                                                "other": 3 * GiB},
               capacity=40 * GiB, world_size=4, layers=16, mixed_precision=True, frozen_share=0.0,
               checkpointable=12 * GiB, first_step_excess=GiB, workload="training")
    saved, _ = remedy.estimate(d)
    assert saved is not None
    assert remedy.plan is not None
    config = {"x": plan.Level(remedy.id.value, "", 1.0, remedy.plan.value(d))}
    assert abs((d.total - plan.formula_peak(d, config)) - saved) <= 1


def test_the_run_log_pairs_each_config_variable_with_the_remedies_that_change_it():
    assert VARIABLE_REMEDIES["gpus"] == (RemedyId.ZERO1, RemedyId.ZERO2, RemedyId.ZERO3, RemedyId.TENSOR_PARALLEL)
    assert VARIABLE_REMEDIES["precision"] == VARIABLE_REMEDIES["autocast"] == (RemedyId.BF16,)


def test_the_simulated_remedy_runs_are_registered_replayable_remedies():
    pytest.importorskip("torch")
    from analyzer.simulate.remedy_runs import REMEDY_RUNS

    assert all(BY_ID[remedy].replay is not None for remedy in REMEDY_RUNS)


def test_the_docs_table_lists_every_remedy():
    spec = importlib.util.spec_from_file_location("docs_tables", ROOT / "docs" / "hooks" / "tables.py")
    assert spec is not None and spec.loader is not None
    tables = importlib.util.module_from_spec(spec)
    sys.modules["docs_tables"] = tables
    spec.loader.exec_module(tables)
    table = tables.remedies_table()
    for r in REMEDIES:
        assert f"| `{r.id}` |" in table and r.docs in table
    page = (ROOT / "docs" / "design" / "remedies.md").read_text(encoding="utf-8")
    assert "<!-- remedies -->" in page
