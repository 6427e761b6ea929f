"""Story 5: "The first optimizer step OOMs, later steps would fit." The adam_first_step scenario replayed on a
device just too small for its first optimizer step (simulated, so the truth is known)."""
from __future__ import annotations

import re
from pathlib import Path

import analyzer
from analyzer.simulate.runner import simulate_to_files, trace_training
from analyzer.simulate.scenarios import SCENARIOS

GiB = 2**30


def test_oom_in_the_first_optimizer_step(tmp_path: Path) -> None:
    scenario = SCENARIOS["adam_first_step"]
    run = trace_training(scenario.loop(), scenario.steps, fake=True)
    out = tmp_path / "first_step.pickle"
    simulate_to_files(run, out, 9 * GiB, scenario.settings, scenario="adam_first_step_oom", findings={})
    d = analyzer.analyze(out).devices[0]
    oom = next(f for f in d.diagnosis.findings if f.kind == "oom")
    assert (oom.phase, oom.step) == ("optimizer", 1)
    spike = next(f for f in d.diagnosis.findings if f.kind == "optimizer_spike")
    assert spike.oom_in_first_step and spike.optimizer == "Adam"
    # the lazily created state is Adam's two fp32 moments of every parameter seen so far
    assert spike.lazy_state_bytes > 0
    remedies = [r["id"] for r in d.diagnosis.remedies]
    assert remedies[0] == "init_optimizer_state"
    assert {"optimizer_8bit", "zero1"} <= set(remedies)
    # the sentence names the place: the optimizer step of the first step, where the lazy state is created
    assert re.match(r"Out of memory on cuda:0 in the optimizer step of step 1( \([^)]*\))?: ", d.diagnosis.verdict), \
        d.diagnosis.verdict
    assert d.diagnosis.triage["verdict"] == "phase_spike"
