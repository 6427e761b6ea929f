"""Advice an expert would sign (issue 32), each rule tested on both sides of what decides it, and on the real
recording where it was seen (read from ../shared/real, skipped when that folder is absent).

Thresholds are written here with their documented values; inputs sit one block either side of them.
"""
from __future__ import annotations

from typing import Any

import pytest

import analyzer
from analyzer.core.vocabulary import RECORD_HISTORY
from analyzer.ingest.snapshot import snapshot_to_trace
from support.paths import REAL
from support.snapshots import BLOCK, MiB, Recording

RECOVERY_THRESHOLD = 0.05     # fragmentation.RECOVERY_THRESHOLD: 5% of the reserve free is worth a word
END_STATE_MODEL_SHARE = 0.05  # workload.END_STATE_MODEL_SHARE: parameters of 5% of an end state show a model


def _real(relative: str) -> Any:
    path = REAL / relative
    if not path.exists():
        pytest.skip(f"{path} is absent (the real recordings live in ../shared/real)")
    return analyzer.analyze(path)


def _end_state(rec: Recording, **settings: Any) -> Any:
    """The snapshot `rec` would dump with no history recorded: its segments and blocks (with their frames) only."""
    snapshot = rec.snapshot(**settings)
    snapshot["device_traces"] = [[] for _ in snapshot["device_traces"]]
    snapshot["external_annotations"] = []
    return analyzer.analyze(snapshot_to_trace(snapshot, "end state")).devices[0].diagnosis


# ---- a snapshot without history says what its end state can tell --------------------------------------------
def test_a_real_snapshot_without_history_says_what_is_free_and_how_to_record_more():
    d = _real("kkaitlyn111-cs336-a2/memory_snapshot.pickle").devices[0].diagnosis
    assert d.verdict.startswith("51.30 GiB allocated on cuda:0 when the snapshot was taken.")
    assert "19.39 GiB (27%) of the 70.69 GiB reserved is cached but free" in d.verdict
    assert "the largest free block 314.00 MiB" in d.verdict
    assert "fragmentation: set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in d.verdict
    assert RECORD_HISTORY in d.verdict
    assert d.workload["kind"] == "unknown", "nothing in an end state without a model shows a forward"


def _one_segment(used: int) -> Recording:
    rec = Recording()
    segment = rec.reserve(100 * MiB)
    rec.alloc(used, segment=segment)
    return rec


@pytest.mark.parametrize(("used", "fragmented"), [(100 * MiB - int(RECOVERY_THRESHOLD * 100 * MiB), True),
                                                  (100 * MiB - int(RECOVERY_THRESHOLD * 100 * MiB) + BLOCK, False)],
                         ids=["5% free", "under 5% free"])
def test_an_end_state_with_a_twentieth_of_its_reserve_free_names_fragmentation(used, fragmented):
    verdict = _end_state(_one_segment(used)).verdict
    assert ("that free memory is fragmentation: set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in verdict) \
        is fragmented
    assert ("the work itself did not fit" in verdict) is not fragmented


def test_an_end_state_with_expandable_segments_on_is_not_told_to_turn_them_on():
    verdict = _end_state(_one_segment(50 * MiB), expandable_segments=True).verdict
    assert "expandable_segments:True" not in verdict and "expandable segments are on" in verdict


MODEL_AT = int(END_STATE_MODEL_SHARE * 100 * MiB)


@pytest.mark.parametrize(("parameters", "kind"), [(MODEL_AT, "forward_only"), (MODEL_AT - BLOCK, "unknown")],
                         ids=["5% parameters", "under 5%"])
def test_an_end_state_is_forward_only_only_when_it_holds_a_model(parameters, kind):
    rec = Recording()
    rec.alloc(parameters, where="model.py:12", name="__init__")
    rec.alloc(100 * MiB - parameters, where="model.py:40", name="forward")
    d = _end_state(rec)
    assert d.workload["kind"] == kind
    assert d.workload["summary"].startswith("forward only" if kind == "forward_only" else "unknown (no allocation")


def test_a_real_end_state_of_loaded_weights_alone_stays_forward_only():
    d = _real("yiyi-llm-inference/oom_snapshot.pickle").devices[0].diagnosis
    assert d.workload["kind"] == "forward_only" and "parameters are 100% of the peak" in d.verdict
