"""Diagnosis against ground truth: the finding kinds each simulated scenario must produce (recall) and nothing
else (precision), OOM verdicts, what to try first, the estimate stories of USER-STORIES.md, and `analyze diff`.

Expected kinds come from what each scenario was built to show (its truth's `scenario` and `findings.claim`),
plus what its truth measures say about the peak: `activation_peak` where activations are the largest category
at the true peak, `optimizer_spike` where the true peak of an optimizer step is the highest outside saving.
The `fragmentation` finding (informational: reserved minus allocated over 5% of reserved) is expected only
where the scenario is about fragmentation; elsewhere it is listed, not scored.

    python tests/e2e/test_diagnosis.py    # prints the expected-vs-reported table of the README's Accuracy section
"""
from __future__ import annotations

import json
import math
from functools import cache
from pathlib import Path

import pytest

from analyzer.commands.diff import compare
from analyzer.commands.estimate import Shape, estimate
from analyzer.diagnose.remedies import Demand, rank_remedies
from analyzer.pipeline import analyze
from analyzer.result import Analysis

SIM = Path(__file__).resolve().parents[2] / "fixtures" / "traces" / "sim"
INFORMATIONAL = "fragmentation"
# what each scenario was built to show: finding kind -> the OOM verdict it must carry (None: not an OOM)
CLAIMED: dict[str, dict[str, str | None]] = {
    "gpt_activation_peak": {"activation_peak": None},
    "adam_first_step": {"optimizer_spike": None},
    "checkpoint_gather": {"checkpoint_gather": None},
    "fragmentation": {"oom": "fragmentation"},   # an OOM fragmentation caused is the oom finding's verdict
    "capacity_oom": {"oom": "capacity"},
    "expandable": {},
    "leak": {"leak": None},
    "activation_cache": {"leak": None},
    "healthy": {},
}
# what the scenario shows is not there: the allocator setting removes the OOM, the fixed loop does not leak
ABSENT = {"expandable": {"oom"}, "healthy": {"leak"}}
BATCH_OR_ACTIVATION = {"micro_batch", "gradient_accumulation", "activation_checkpointing", "bf16"}
GB = 10**9
GiB = 1 << 30


def fixtures() -> list[str]:
    return sorted(p.stem for p in SIM.glob("*.pickle"))


def truth(name: str) -> dict:
    return json.loads((SIM / f"{name}.truth.json").read_text())


@cache
def analysis(name: str) -> Analysis:
    return analyze(SIM / f"{name}.pickle")


def _optimizer_peaks_the_run(measures: dict) -> bool:
    """The detector's rule on the truth's labels: an optimizer step's peak at least the peak outside it and saving."""
    phases = {key.split(":", 1)[1]: 0 for key in measures["peak_by_step_phase"]}
    for key, value in measures["peak_by_step_phase"].items():
        phase = key.split(":", 1)[1]
        phases[phase] = max(phases[phase], value)
    elsewhere = max((v for p, v in phases.items() if p not in ("optimizer", "checkpoint_save")), default=0)
    return "optimizer" in phases and phases["optimizer"] >= elsewhere


def expected(name: str) -> dict[str, str | None]:
    """Finding kind -> OOM verdict (None for other kinds) that the fixture must produce."""
    t = truth(name)
    kinds = dict(CLAIMED[t["scenario"]])
    by_category = t["measures"]["peak_by_category"]
    if max(by_category, key=by_category.get) == "activation":
        kinds.setdefault("activation_peak", None)
    if _optimizer_peaks_the_run(t["measures"]):
        kinds.setdefault("optimizer_spike", None)
    return kinds


def reported(name: str) -> dict[str, str | None]:
    """Finding kind -> OOM verdict (None for other kinds) that `analyze` reports."""
    return {f.kind.value: getattr(f, "verdict", None) for f in analysis(name).devices[0].diagnosis.findings}


def score(name: str) -> dict[str, set[str]]:
    """Matched, missing (expected, not reported or wrong verdict), unexpected and informational kinds."""
    want, got = expected(name), reported(name)
    matched = {k for k in want if k in got and got[k] == want[k]}
    extra = set(got) - set(want)
    return {"matched": matched, "missing": set(want) - matched, "unexpected": extra - {INFORMATIONAL},
            "informational": extra & {INFORMATIONAL}}


def _kinds(kinds: dict[str, str | None] | set[str]) -> str:
    items = kinds.items() if isinstance(kinds, dict) else ((k, None) for k in kinds)
    return ", ".join(sorted(f"{k} ({v})" if v else k for k, v in items)) or "none"


def findings_table() -> str:
    """Markdown: per fixture, expected vs reported kinds, then precision and recall over all fixtures."""
    lines = ["| fixture | expected | reported | missing | unexpected | fragmentation (informational) |",
             "|---|---|---|---|---|---|"]
    totals = {"matched": 0, "missing": 0, "unexpected": 0}
    for name in fixtures():
        s = score(name)
        for key in totals:
            totals[key] += len(s[key])
        lines.append(f"| {name} | {_kinds(expected(name))} | {_kinds(reported(name))} | {_kinds(s['missing'])} | "
                     f"{_kinds(s['unexpected'])} | {'yes' if s['informational'] else 'no'} |")
    precision = totals["matched"] / max(1, totals["matched"] + totals["unexpected"])
    recall = totals["matched"] / max(1, totals["matched"] + totals["missing"])
    return "\n".join(lines) + f"\n\nprecision {precision:.0%}, recall {recall:.0%} over {len(fixtures())} fixtures"


# ---- findings ------------------------------------------------------------------------------------------------
def test_every_fixture_has_an_expectation():
    assert fixtures() and {truth(n)["scenario"] for n in fixtures()} <= set(CLAIMED)


@pytest.mark.parametrize("name", fixtures())
def test_expected_findings_are_reported(name):
    assert not score(name)["missing"], f"{name}: expected {expected(name)}, reported {reported(name)}"


@pytest.mark.parametrize("name", fixtures())
def test_nothing_unexpected_is_reported(name):
    assert not score(name)["unexpected"], f"{name}: expected {expected(name)}, reported {reported(name)}"
    assert not set(reported(name)) & ABSENT.get(truth(name)["scenario"], set())


@pytest.mark.parametrize("name", fixtures())
def test_an_oom_is_reported_with_its_verdict_exactly_where_the_truth_has_one(name):
    claimed = CLAIMED[truth(name)["scenario"]]
    assert ("oom" in claimed) == (truth(name)["oom"] is not None)
    assert reported(name).get("oom") == claimed.get("oom")


def _try_first(name: str) -> str:
    return next(r["id"] for r in analysis(name).devices[0].diagnosis.remedies if r["try_first"])


def test_fragmentation_oom_tries_expandable_segments_first():
    assert _try_first("fragmentation") == "expandable_segments"


def test_capacity_oom_tries_a_batch_or_activation_remedy_first():
    assert _try_first("capacity_oom") in BATCH_OR_ACTIVATION


# ---- remedy estimates (benchmarks/remedy_accuracy.py measures them against simulated runs) -----------------
def _saving(remedy: str, by_category: dict[str, int], mixed_precision: bool | None) -> int:
    demand = Demand(total=sum(by_category.values()), by_category=by_category, capacity=None, world_size=None,
                    layers=12, mixed_precision=mixed_precision)
    return next(r for r in rank_remedies(demand) if r["id"] == remedy)["saved_bytes"]


def test_accumulation_keeps_the_gradients_alive_through_the_second_micro_batch():
    forward_peak = {"activation": 20 * GiB, "parameter": 4 * GiB, "optimizer_state": 8 * GiB}
    assert _saving("gradient_accumulation", forward_peak, mixed_precision=False) == 10 * GiB - 4 * GiB
    with_gradients = {**forward_peak, "gradient": 4 * GiB}     # zero_grad(set_to_none=False): already there
    assert _saving("gradient_accumulation", with_gradients, mixed_precision=False) == 10 * GiB


def test_accumulation_bounds_trainable_gradients_by_the_optimizer_state_when_states_do_not_match_adam():
    frozen = {"activation": 20 * GiB, "parameter": 14 * GiB, "optimizer_state": GiB // 2}   # LoRA-like
    assert _saving("gradient_accumulation", frozen, mixed_precision=None) == 10 * GiB - GiB // 2


def test_bf16_counts_the_weight_copies_autocast_keeps():
    assert _saving("bf16", {"activation": 20 * GiB, "parameter": 4 * GiB}, mixed_precision=False) == 10 * GiB - 2 * GiB


# ---- estimate: USER-STORIES.md stories 2 and 3 -----------------------------------------------------------------
def test_story_2_seven_billion_on_one_80gb_card_does_not_fit_whatever_the_batch():
    smallest = estimate(7e9, gpus=1, zero=0, gpu_memory=80 * GB, shape=Shape(1, 2048, 32, 4096, 32), checkpointing=True)
    assert smallest["model_states_bytes"] == 112 * GB > smallest["usable_bytes"]   # 16Ψ alone is too much
    assert smallest["fits"] is False                                                  # micro-batch 1, checkpointed


def test_story_2_zero2_on_8_gpus_gives_2psi_plus_14psi_over_8():
    result = estimate(7e9, gpus=8, zero=2, gpu_memory=80 * GB, shape=Shape(32, 2048, 32, 4096, 32), checkpointing=False)
    assert result["model_states_per_gpu_bytes"] == int(2 * 7e9 + 14 * 7e9 / 8) == 26_250_000_000
    checkpointed = next(o for o in result["options"] if o["option"].startswith("activation checkpointing, ZeRO-2"))
    assert checkpointed["fits"]


def test_story_3_seventy_billion_on_8x80gb_lists_what_fits():
    result = estimate(70e9, gpus=8, zero=3, gpu_memory=80 * GB, shape=None, checkpointing=False)
    assert result["model_states_per_gpu_bytes"] == 140 * GB > result["usable_bytes"]   # no batch size can fit
    assert result["fits"] is False
    options = {o["option"]: o for o in result["options"]}
    offload = next(o for name, o in options.items() if name.startswith("optimizer state offloaded to CPU"))
    assert offload["fits"] and offload["per_gpu_bytes"] == 4 * 70e9 / 8
    assert any(name.startswith("8-bit optimizer states") for name in options)
    more = next(o for o in result["options"] if "gpus_needed" in o)
    assert more["gpus_needed"] == math.ceil(16 * 70e9 / result["usable_bytes"]) > 8 and more["fits"]


def test_story_3_micro_batch_1_with_checkpointing_still_does_not_fit():
    result = estimate(70e9, gpus=8, zero=3, gpu_memory=80 * GB, shape=Shape(1, 4096, 80, 8192, 64), checkpointing=True)
    assert result["fits"] is False and result["per_gpu_bytes"] > result["model_states_per_gpu_bytes"] == 140 * GB


# ---- analyze diff on two fixtures ---------------------------------------------------------------------------
def test_diff_measures_the_saving_of_fixing_the_leak():
    """leak and healthy run the same loop but for the kept metric: the saving is the difference of the true peaks."""
    result = compare(analysis("leak"), analysis("healthy"))["devices"][0]
    saving = truth("leak")["measures"]["peak_allocated_bytes"] - truth("healthy")["measures"]["peak_allocated_bytes"]
    assert result["saving_bytes"] == saving > 0
    assert result["remedy_check"]["remedy"] == "fix_leak" and abs(result["remedy_check"]["error"]) <= 0.15


def test_diff_credits_the_allocator_setting_when_the_oom_is_gone():
    """fragmentation and expandable run the same workload: the memory needed stays, the OOM goes."""
    result = compare(analysis("fragmentation"), analysis("expandable"))["devices"][0]
    assert result["oom_before"] and not result["oom_after"]
    assert abs(result["saving_bytes"]) < 0.01 * result["needed_before_bytes"]
    assert result["remedy_check"]["remedy"] == "expandable_segments"


if __name__ == "__main__":
    print(findings_table())
