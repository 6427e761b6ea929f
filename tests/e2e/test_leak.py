"""Leaks (story 7): growth across steps is told apart from a run that is simply too large, measured against the
simulator's ground truth, a CPU-profiled leaking loop, and real snapshots that must not be called leaks."""
from __future__ import annotations

import json
import math
import pickle
import re
import statistics
from pathlib import Path
from typing import Any

import pytest

import analyzer
from analyzer.diagnose import leak
from analyzer.simulate.scenarios import SCENARIOS
from support.paths import FIXTURES, real_snapshots

SIM = FIXTURES / "sim"
KINETO = FIXTURES / "kineto"
LEAKS = {"sim/leak", "sim/activation_cache", "kineto/leak"}
CASES = [f"sim/{name}" for name in SCENARIOS] + \
        [f"kineto/{p.name.removesuffix('.pt.trace.json.gz')}" for p in sorted(KINETO.glob("*.pt.trace.json.gz"))]
BATCH_SIZE_REMEDIES = {"micro_batch", "gradient_accumulation"}


def _path(case: str) -> Path:
    kind, name = case.split("/")
    return SIM / f"{name}.pickle" if kind == "sim" else KINETO / f"{name}.pt.trace.json.gz"


def _truth(name: str) -> dict:
    return json.loads((SIM / f"{name}.truth.json").read_text())


@pytest.fixture(scope="module")
def analyses() -> dict[str, analyzer.Analysis]:
    """Every case analysed once; simulated runs with their device size, as `--gpu-memory` would give it."""
    return {case: analyzer.analyze(_path(case), gpu_memory=_truth(case[4:])["gpu_memory"] if case.startswith("sim/")
                                   else None) for case in CASES}


def _kinds(analysis: analyzer.Analysis, kind: str) -> list[Any]:
    return [f for d in analysis.devices for f in d.diagnosis.findings if f.kind == kind]


def _truth_growth(name: str) -> float:
    """Per-step growth in the ground truth: the memory in use at each step's start (the batch being loaded,
    phase `other`), step over step, from step 2 on (step 1 also creates the optimizer state)."""
    levels = _truth(name)["measures"]["peak_by_step_phase"]
    starts = [levels[f"{step}:other"] for step in range(2, _truth(name)["steps"] + 1)]
    return statistics.median(b - a for a, b in zip(starts, starts[1:], strict=False))


# ---- detection: precision and recall on the set ---------------------------------------------------
def test_leak_precision_and_recall(analyses):
    flagged = {case for case, a in analyses.items() if _kinds(a, "leak")}
    for case in CASES:
        print(f"{case:28s} truth={'leak' if case in LEAKS else '-':5s} found={'leak' if case in flagged else '-'}")
    true_positives = len(flagged & LEAKS)
    precision = true_positives / len(flagged) if flagged else 1.0
    recall = true_positives / len(LEAKS)
    print(f"leak findings on {len(CASES)} fixtures: precision {precision:.0%}, recall {recall:.0%}")
    assert LEAKS <= set(CASES)
    assert precision == 1.0 and recall == 1.0


@pytest.mark.parametrize("snapshot", real_snapshots(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_real_snapshots_have_no_leak(real_dir, snapshot):
    analysis = analyzer.analyze(snapshot)
    assert not _kinds(analysis, "leak")
    assert all(d.diagnosis.triage["verdict"] != "leak" for d in analysis.devices)


@pytest.mark.parametrize("name", ["leak", "activation_cache"])
def test_bytes_per_step_matches_the_truth(analyses, name):
    (finding,) = _kinds(analyses[f"sim/{name}"], "leak")
    truth = _truth_growth(name)
    print(f"{name}: measured {finding.bytes_per_step} bytes per step, truth {truth:.0f}")
    assert abs(finding.bytes_per_step - truth) <= 0.10 * truth


@pytest.mark.parametrize("name", ["leak", "activation_cache"])
def test_steps_to_oom_at_the_measured_rate(analyses, name):
    (finding,) = _kinds(analyses[f"sim/{name}"], "leak")
    truth = _truth(name)
    expected = (truth["gpu_memory"] - truth["measures"]["peak_allocated_bytes"]) / _truth_growth(name)
    assert abs(finding.steps_to_oom - expected) <= 0.10 * expected + 1
    assert finding.oom_step == truth["steps"] + finding.steps_to_oom


# ---- where it comes from -----------------------------------------------------------------------------
def test_the_leak_points_at_the_line_that_kept_the_metric(analyses):
    source = Path(leak.__file__).parents[1] / "simulate" / "scenarios.py"
    line = next(i for i, text in enumerate(source.read_text().splitlines(), 1) if "forgot .item()" in text)
    (finding,) = _kinds(analyses["sim/leak"], "leak")
    assert finding.stacks[0]["top_user_frame"].endswith(f"scenarios.py:{line} __call__")


def test_activations_cached_on_modules_are_grouped_by_module(analyses):
    (finding,) = _kinds(analyses["sim/activation_cache"], "leak")
    modules = {s["module"] for s in finding.stacks}
    assert modules == {f"layers.{i}.mlp.fc" for i in range(6)}
    assert len({s["bytes_per_step"] for s in finding.stacks}) == 1     # each layer keeps the same tensor


def test_the_cpu_profiled_leak_points_at_the_validation_forward(analyses):
    (finding,) = _kinds(analyses["kineto/leak"], "leak")
    assert finding.bytes_per_step > 0 and finding.steps_to_oom is None    # a CPU run: no device size
    assert all(s["top_user_frame"].startswith("record_kineto_fixtures.py:") for s in finding.stacks)


# ---- triage, verdict and remedies ----------------------------------------------------------------------
EXPECTED_TRIAGE = {"sim/healthy": "steady_state", "sim/adam_first_step": "phase_spike",
                   "sim/checkpoint_gather": "phase_spike", "sim/capacity_oom": "steady_state"}


@pytest.mark.parametrize("case", CASES)
def test_triage_says_leak_exactly_for_the_leaks(analyses, case):
    for d in analyses[case].devices:
        assert d.diagnosis.triage["verdict"] in ("outside_pytorch", "leak", "phase_spike", "steady_state") and d.diagnosis.triage["reason"]
        assert (d.diagnosis.triage["verdict"] == "leak") == (case in LEAKS)
        if case in EXPECTED_TRIAGE:
            assert d.diagnosis.triage["verdict"] == EXPECTED_TRIAGE[case]


@pytest.mark.parametrize("case", sorted(LEAKS))
def test_a_leak_gets_fix_the_leak_first_and_no_batch_size_advice(analyses, case):
    (d,) = analyses[case].devices
    (finding,) = _kinds(analyses[case], "leak")
    first = d.diagnosis.remedies[0]
    assert first["id"] == "fix_leak" and first["try_first"] and sum(r["try_first"] for r in d.diagnosis.remedies) == 1
    assert all(leak.place(s) in first["how"] for s in finding.stacks)
    assert not BATCH_SIZE_REMEDIES & {r["id"] for r in d.diagnosis.remedies}
    assert "a leak, not the size of the work" in d.diagnosis.verdict and "per step" in d.diagnosis.verdict
    assert "batch" not in re.split("(?i)try first", d.diagnosis.verdict)[1]


def test_the_story_sentence(analyses):
    """Story 7: leak, not size; bytes per step; the allocating stack; steps to OOM; no batch-size advice."""
    d = analyses["sim/leak"].devices[0]
    (finding,) = _kinds(analyses["sim/leak"], "leak")
    print(d.diagnosis.verdict)
    assert "+500.0 MiB per step" in d.diagnosis.verdict and "scenarios.py" in d.diagnosis.verdict
    assert f"out of memory in about {finding.steps_to_oom} more steps at this rate" in d.diagnosis.verdict


def test_healthy_runs_keep_their_batch_size_advice(analyses):
    assert {"micro_batch"} <= {r["id"] for r in analyses["sim/healthy"].devices[0].diagnosis.remedies}


def test_leak_json_fields(analyses):
    doc = json.loads(analyses["sim/leak"].to_json_text())
    device = doc["devices"][0]
    assert device["triage"]["verdict"] == "leak" and device["triage"]["reason"]
    (finding,) = [f for f in device["findings"] if f["kind"] == "leak"]
    assert {"bytes_per_step", "steps_to_oom", "stacks", "summary", "evidence"} <= set(finding)
    assert set(finding["stacks"][0]) >= {"top_user_frame", "module", "bytes_per_step"}
    assert all(isinstance(analyses[c].to_json()["devices"][0]["triage"], dict) for c in CASES)


# ---- reserved growth: the cache, not the tensors ---------------------------------------------------------
MiB = 1 << 20


def _ratchet_snapshot(steps: int = 6) -> dict:
    """A snapshot where each step allocates a 48 MiB activation in a new 64 MiB segment and frees it, and the
    allocator keeps every segment cached: reserved grows 64 MiB a step, allocated returns to the same level."""
    base, t = 0x7F0000000000, 1_000
    trace, annotations = [], []
    frames = [{"filename": "train.py", "line": 42, "name": "forward"}]

    def entry(action: str, addr: int, size: int) -> None:
        nonlocal t
        t += 10
        trace.append({"action": action, "addr": addr, "size": size, "stream": 0, "time_us": t, "frames": frames})

    entry("segment_alloc", base, 32 * MiB)
    entry("alloc", base, 32 * MiB)
    segments = [{"device": 0, "address": base, "total_size": 32 * MiB, "stream": 0, "segment_type": "large",
                 "blocks": [{"address": base, "size": 32 * MiB, "requested_size": 32 * MiB, "state": "active_allocated",
                             "frames": frames}]}]
    for step in range(1, steps + 1):
        annotations.append({"stage": "START", "name": f"ProfilerStep#{step}", "device": 0, "time_us": t + 1})
        addr = base + step * 64 * MiB
        for action, size in (("segment_alloc", 64 * MiB), ("alloc", 48 * MiB), ("free_requested", 48 * MiB),
                             ("free_completed", 48 * MiB)):
            entry(action, addr, size)
        annotations.append({"stage": "END", "name": f"ProfilerStep#{step}", "device": 0, "time_us": t + 1})
        t += 10
        segments.append({"device": 0, "address": addr, "total_size": 64 * MiB, "stream": 0, "segment_type": "large",
                         "blocks": [{"address": addr, "size": 64 * MiB, "requested_size": 0, "state": "inactive"}]})
    return {"segments": segments, "device_traces": [trace], "external_annotations": annotations,
            "allocator_settings": {"expandable_segments": False}}


def test_reserved_growth_is_reported_apart_from_a_leak(tmp_path):
    path = tmp_path / "ratchet.pickle"
    path.write_bytes(pickle.dumps(_ratchet_snapshot()))
    analysis = analyzer.analyze(path, gpu_memory=1 << 30)
    d = analysis.devices[0]
    (finding,) = _kinds(analysis, "reserved_growth")
    print(finding.summary)
    assert finding.bytes_per_step == 64 * MiB
    assert finding.steps_to_oom == math.ceil((1024 - 32 - 6 * 64) * MiB / (64 * MiB))
    assert not _kinds(analysis, "leak") and d.diagnosis.triage["verdict"] != "leak"
    assert "expandable_segments" in {r["id"] for r in d.diagnosis.remedies}


@pytest.mark.parametrize("case", sorted(LEAKS | {"sim/healthy"}))
def test_leaks_and_healthy_runs_show_no_reserved_growth(analyses, case):
    assert not _kinds(analyses[case], "reserved_growth")
