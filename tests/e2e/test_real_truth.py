"""Model states at the peak of every real recording against what the recording's own source code says
(../shared/real/truth.json; analyzer.evaluate.real_truth), and no forward-pass allocation labelled gradient."""
from __future__ import annotations

import pytest

import analyzer
from analyzer.evaluate.real_truth import Check, checks, load_truth
from support.paths import REAL, real_snapshots


def _checks() -> list[Check]:
    if not REAL.is_dir():
        return []
    return [c for name, t in load_truth(REAL).items() for c in checks(REAL, name, t)]


CHECKS = _checks()


@pytest.mark.parametrize("check", CHECKS, ids=[f"{c.recording}:{c.device}:{c.category}" for c in CHECKS])
def test_model_states_at_the_peak_agree_with_the_source(check: Check) -> None:
    if not check.held:   # made before a trace with no running total: nothing of it may be invented
        assert check.measured_bytes == 0 and not check.agrees
        return
    assert check.agrees, (f"{check.recording} {check.device} {check.category}: {check.measured_bytes} B measured, "
                          f"{check.truth_bytes} B in the source")


def test_the_truth_is_there() -> None:
    if not REAL.is_dir():
        pytest.skip(f"real recordings not found at {REAL}")
    assert len(CHECKS) >= 60
    assert sum(not c.held for c in CHECKS) == 9   # the three 2021 ResNet-50 traces, three states each


@pytest.mark.parametrize("path", real_snapshots(), ids=lambda p: str(p.relative_to(REAL)))
def test_no_gradient_is_made_before_its_steps_backward_begins(path) -> None:
    """A gradient made while the forward pass still runs is a forward allocation mislabelled."""
    result = analyzer.analyze(path)
    assert isinstance(result, analyzer.Analysis)
    a = result.trace.allocations
    made = a[a["t_alloc_us"].notna() & a["step"].notna()]
    backward_start = made[made["phase"].astype(str) == "backward"].groupby("step")["t_alloc_us"].min()
    gradients = made[made["category"].astype(str) == "gradient"]
    starts = gradients["step"].map(backward_start)
    early = gradients[starts.isna() | (gradients["t_alloc_us"] < starts)]
    assert early.empty, early[["t_alloc_us", "requested_bytes", "phase", "label_source"]].head()


def test_a_memory_timeline_keeps_torchs_own_categories(real_dir) -> None:
    """export_memory_timeline carries torch's category for every byte: the peak's breakdown is torch's (its
    AUTOGRAD_DETAIL, intermediate gradients, is our temporary), exactly as the file's own columns at the peak."""
    name = "cwilson51-colloquium/train_batch_128_nworkers_6_memory_broken.json"
    columns = load_truth(real_dir)[name]["file_columns_at_peak"]
    expected = {"activation": columns["ACTIVATION"], "temporary": columns["AUTOGRAD_DETAIL"] + columns["TEMPORARY"],
                "parameter": columns["PARAMETER"], "gradient": columns["GRADIENT"],
                "optimizer_state": columns["OPTIMIZER_STATE"], "input": columns["INPUT"],
                "unattributed": columns["unknown"]}
    result = analyzer.analyze(real_dir / name)
    assert isinstance(result, analyzer.Analysis)
    d = result.devices[0]
    assert {r["name"]: r["bytes"] for r in d.by_category} == {k: v for k, v in expected.items() if v}
    assert set(result.trace.allocations["label_source"].astype(str).str.split(";").str[1]) >= {
        "category=recording:torch-memory-profiler"}
