"""Replayed predictions against simulated runs with each remedy applied (small GPTs, so the test stays fast):
the issue's bars, 10% for micro-batch, accumulation, checkpointing and ZeRO (ZeRO-3 / FSDP against a run whose
parameters are gathered per block as it runs), 25% for bf16; and expandable segments on the fragmentation
scenario, whose recording ran out of memory and whose expandable twin did not."""
from __future__ import annotations

from pathlib import Path

import pytest

from analyzer.diagnose.counterfactual import predict, recorded_stream, replay, usable_capacity
from analyzer.pipeline import analyze
from analyzer.simulate.gpt import GPTConfig
from analyzer.simulate.remedy_runs import REMEDY_RUNS, SHARDS, RemedySetup, simulate
from tests.support.paths import SIM

GiB = 1 << 30
BARS = {"micro_batch": 0.10, "gradient_accumulation": 0.10, "activation_checkpointing": 0.10, "zero1": 0.10,
        "zero2": 0.10, "zero3": 0.10, "bf16": 0.25}
SMALL = GPTConfig(vocab=8000, d_model=256, layers=4, heads=4, max_seq=512)
SETUPS = {
    "activations": (RemedySetup("eager d256 L4 s512 b4", SMALL, batch=4, seq=512),
                    ["micro_batch", "gradient_accumulation", "activation_checkpointing", "bf16"]),
    "model states": (RemedySetup("d1024 L4 s64 b1", GPTConfig(vocab=8000, d_model=1024, layers=4, heads=8, max_seq=64),
                                 batch=1, seq=64), ["zero1", "zero2", "zero3"]),
}


@pytest.mark.parametrize("name", SETUPS)
def test_replayed_peaks_meet_the_bars(name: str, tmp_path: Path):
    setup, remedies = SETUPS[name]
    simulate(setup, tmp_path / "base.pickle")
    before = analyze(tmp_path / "base.pickle")
    predictions = predict(before.trace, 0, remedies, None, SHARDS)
    base = before.devices[0].peak.allocated_bytes
    for remedy in remedies:
        simulate(REMEDY_RUNS[remedy](setup), tmp_path / f"{remedy}.pickle")
        simulated = analyze(tmp_path / f"{remedy}.pickle").devices[0].peak.allocated_bytes
        predicted = predictions[remedy].peak_allocated_bytes
        assert simulated < base, f"{remedy} saves memory in the simulated run"
        assert abs(predicted - simulated) <= BARS[remedy] * simulated, (remedy, predicted, simulated)


def test_expandable_segments_replay_removes_the_fragmentation_oom():
    before = analyze(SIM / "fragmentation.pickle", gpu_memory=22 * GiB)
    after = analyze(SIM / "expandable.pickle", gpu_memory=22 * GiB).devices[0]
    stream = recorded_stream(before.trace, 0)
    assert stream is not None
    unchanged = replay(stream, usable_capacity(before.trace, 0, 22 * GiB))
    predicted = predict(before.trace, 0, ["expandable_segments"], 22 * GiB, None)["expandable_segments"]
    assert before.devices[0].oom is not None and unchanged.oom is True        # the replay reproduces the OOM
    assert after.oom is None and predicted.oom is False
    assert abs(predicted.peak_reserved_bytes - after.reserved_peak_bytes) <= 0.10 * after.reserved_peak_bytes
