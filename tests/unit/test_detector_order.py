"""Detectors return what they find and write nothing into the shared context: what one measures and another
reads (the fragmentation picture at the OOM and at the peak, the leaking allocations) is computed once by
whichever asks first. So their order is presentation only: reversed, every number of the diagnosis is the same."""
from __future__ import annotations

import dataclasses

import pytest

import analyzer
from analyzer import diagnose
from analyzer.core.vocabulary import FindingKind
from support.paths import SIM

GiB = 1 << 30


@pytest.mark.parametrize("name", ["fragmentation.pickle", "leak.pickle"])
def test_reversing_the_detectors_changes_only_the_order_of_the_findings(name, monkeypatch):
    as_is = analyzer.analyze(SIM / name, gpu_memory=22 * GiB).to_json()
    monkeypatch.setattr(diagnose, "DETECTORS", list(reversed(diagnose.DETECTORS)))
    reversed_ = analyzer.analyze(SIM / name, gpu_memory=22 * GiB).to_json()
    kinds = {f["kind"] for d in as_is["devices"] for f in d["findings"]}
    assert kinds <= set(FindingKind) and kinds & {FindingKind.OOM, FindingKind.LEAK}   # findings whose measurements are shared (the OOM's picture, the leak's bytes)
    for before, after in zip(as_is["devices"], reversed_["devices"], strict=True):
        assert sorted(map(repr, before.pop("findings"))) == sorted(map(repr, after.pop("findings")))
        assert before == after


def test_the_context_holds_no_detector_results():
    from analyzer.diagnose.context import DeviceContext

    names = {f.name for f in dataclasses.fields(DeviceContext)}
    assert not names & {"fragmentation_at_oom", "fragmentation_at_peak", "leaked_allocations"}
