"""What explains a peak, at the boundaries of each decision, on hand-made snapshots:

- memory outside PyTorch, measured by a recorder that sees the whole device: reported from 1% of the device
  (analyzer.diagnose.outside.OUTSIDE_SHARE), the first thing to explain from 10% (SIGNIFICANT_SHARE);
- an activation-dominated peak: activations are the largest category at the peak;
- an optimizer spike: the optimizer step peaks at least as high as the rest of the run;
- the sites table of the report: the user lines that made the memory live at the peak.

Sizes of tensors sit one allocator block (512 bytes) either side of a boundary, the closest they can get.
"""
from __future__ import annotations

import math

import pytest

import analyzer
from analyzer.report.view import Site, build_view
from support.snapshots import BLOCK, GiB, MiB, Recording

OUTSIDE_SHARE = 0.01
SIGNIFICANT_SHARE = 0.10
DEVICE = 1 * GiB
WEIGHTS = 32 * MiB


def _kinds(d) -> list[str]:
    return [f.kind for f in d.diagnosis.findings]


# ---- outside PyTorch (OUTSIDE_SHARE, SIGNIFICANT_SHARE) --------------------------------------------------------
def _with_outside(outside: int):
    """One forward step of 96 MiB; the device recorder also sees `outside` bytes PyTorch never reserved."""
    rec = Recording()
    with rec.phase("load"):
        rec.alloc(WEIGHTS, "model.py:3")
    with rec.step(1), rec.phase("forward"):
        rec.alloc(64 * MiB, "model.py:10")
    d = analyzer.analyze(rec.trace(), gpu_memory=DEVICE, device_usage=rec.device_usage(outside)).devices[0]
    found = [f for f in d.diagnosis.findings if f.kind == "outside_pytorch"]
    assert [f.bytes for f in found] in ([], [outside])
    return d, found


NOISE = math.ceil(OUTSIDE_SHARE * DEVICE)
SIGNIFICANT = math.ceil(SIGNIFICANT_SHARE * DEVICE)


@pytest.mark.parametrize(("outside", "reported"), [(NOISE, True), (NOISE - 1, False)], ids=["at", "below"])
def test_memory_outside_pytorch_is_reported_from_1_percent_of_the_device(outside, reported):
    d, found = _with_outside(outside)
    assert bool(found) is reported
    assert [f.severity for f in found] == (["info"] if reported else [])
    assert d.diagnosis.triage["verdict"] == "steady_state"


@pytest.mark.parametrize(("outside", "significant"), [(SIGNIFICANT, True), (SIGNIFICANT - 1, False)],
                         ids=["at", "below"])
def test_memory_outside_pytorch_comes_first_from_10_percent_of_the_device(outside, significant):
    d, (finding,) = _with_outside(outside)
    assert finding.significant is significant
    assert finding.severity == ("critical" if significant else "info")
    assert (d.diagnosis.triage["verdict"] == "outside_pytorch") is significant


# ---- activation-dominated peak ---------------------------------------------------------------------------------
@pytest.mark.parametrize(("activations", "reported"), [(WEIGHTS + BLOCK, True), (WEIGHTS - BLOCK, False)],
                         ids=["above", "below"])
def test_an_activation_peak_is_one_where_activations_are_the_largest_category(activations, reported):
    rec = Recording()
    with rec.phase("load"):
        rec.alloc(WEIGHTS, "model.py:3")
    with rec.step(1), rec.phase("forward"):
        rec.alloc(activations, "model.py:10")
    d = analyzer.analyze(rec.trace()).devices[0]
    assert {r["name"]: r["bytes"] for r in d.by_category} == {"parameter": WEIGHTS, "activation": activations}
    assert ("activation_peak" in _kinds(d)) is reported


# ---- optimizer spike -------------------------------------------------------------------------------------------
FORWARD = 16 * MiB


@pytest.mark.parametrize(("in_optimizer", "reported"), [(FORWARD, True), (FORWARD - BLOCK, False)], ids=["at", "below"])
def test_an_optimizer_step_peaking_as_high_as_the_rest_of_the_run_is_a_spike(in_optimizer, reported):
    """The forward pass and the optimizer step each make and free one temporary; the step is a spike from the
    moment its peak reaches the forward pass's (no OOM here to make it one regardless)."""
    rec = Recording()
    with rec.phase("load"):
        rec.alloc(WEIGHTS, "model.py:3")
    with rec.step(1):
        with rec.phase("forward"):
            rec.free(rec.alloc(FORWARD, "model.py:10"))
        with rec.range("Optimizer.step#Adam.step"):
            rec.free(rec.alloc(in_optimizer, "train.py:30"))
    d = analyzer.analyze(rec.trace()).devices[0]
    spikes = [f for f in d.diagnosis.findings if f.kind == "optimizer_spike"]
    assert [(f.optimizer, f.evidence.details.peak_elsewhere_bytes) for f in spikes] == \
        ([("Adam", WEIGHTS + FORWARD)] if reported else [])
    assert (d.diagnosis.triage["verdict"] == "phase_spike") is reported


# ---- the report's sites ----------------------------------------------------------------------------------------
def test_the_sites_table_groups_the_peak_by_user_line_largest_first():
    rec = Recording()
    with rec.phase("load"):
        rec.alloc(WEIGHTS, "model.py:3")
    with rec.step(1), rec.phase("forward"):
        rec.alloc(16 * MiB, "model.py:10")
        rec.alloc(4 * MiB, "model.py:10")
        rec.free(rec.alloc(2 * MiB, "data.py:4"))    # freed before the peak: not counted
        rec.alloc(8 * MiB, "data.py:4")
    peak = WEIGHTS + 28 * MiB
    (device,) = build_view(analyzer.analyze(rec.trace())).devices
    assert device.peak_allocated_bytes == peak
    assert device.sites == [Site("model.py:3 train_step", 1, WEIGHTS, WEIGHTS / peak),
                            Site("model.py:10 train_step", 2, 20 * MiB, 20 * MiB / peak),
                            Site("data.py:4 train_step", 1, 8 * MiB, 8 * MiB / peak)]
