"""What crosses a layer is typed (issue 30): the result model's fields name their types, never `dict[str, Any]`;
each typed part of the diagnosis has one `to_json`, which writes the analyzer/1 keys as the contract has them."""
from __future__ import annotations

import dataclasses
import typing

import pytest

import analyzer
from analyzer import log_result, result
from analyzer.core.trace import PROFILED_LATE
from analyzer.core.vocabulary import FindingKind
from analyzer.result import FragmentationPicture, FreeInSegment, RegimeCheck, Theory, WorkloadFacts
from support.paths import FIXTURES

CROSSING = [result.DeviceMeasures, result.DeviceAnalysis, result.Diagnosis, result.Analysis, result.SegmentsAt,
            result.FragmentationPicture, result.Theory, result.WorkloadFacts, log_result.LogOom, log_result.LogAnalysis]


@pytest.mark.parametrize("kind", CROSSING, ids=lambda k: k.__name__)
def test_no_field_is_an_untyped_bag(kind: type) -> None:
    untyped = [f"{f.name}: {f.type}" for f in dataclasses.fields(kind) if "Any" in str(f.type)]
    assert not untyped


def test_theory_writes_the_regimes_only_where_parameters_were_found() -> None:
    measured = dict(parameter_bytes=0, gradient_bytes=0, optimizer_state_bytes=0, activation_bytes=7)
    unchecked = Theory(**measured, notes=["none"]).to_json()
    assert list(unchecked) == ["parameter_bytes", "gradient_bytes", "optimizer_state_bytes", "activation_bytes", "notes"]
    checked = Theory(**measured, notes=[], regimes=[RegimeCheck("fp32 Adam", 1.0, 16.0, 4, False)], regime=None)
    assert checked.to_json()["regimes"] == [{"name": "fp32 Adam", "parameters": 1.0, "expected_model_states_bytes": 16.0,
                                             "measured_model_states_bytes": 4, "agrees": False}]
    assert list(checked.to_json())[-2:] == ["regimes", "regime"]


def test_the_fragmentation_picture_writes_its_numbers_then_its_segments() -> None:
    picture = FragmentationPicture(event_index=3, reserved_bytes=10, allocated_bytes=6, inactive_bytes=4, internal_bytes=1,
                                   external_bytes=None, cached_free_segments_bytes=None, largest_free_block_bytes=None,
                                   request_bytes=None, expandable_segments=None, segments_recorded=True,
                                   segments=[FreeInSegment(0, 10, 6, 4, 4)])
    assert list(picture.to_json()) == ["event_index", "reserved_bytes", "allocated_bytes", "inactive_bytes",
                                       "internal_bytes", "external_bytes", "cached_free_segments_bytes",
                                       "largest_free_block_bytes", "request_bytes", "expandable_segments",
                                       "segments_recorded", "segments"]
    assert picture.to_json()["segments"] == [{"addr": 0, "bytes": 10, "used_bytes": 6, "free_bytes": 4,
                                              "largest_free_bytes": 4}]
    assert "segments" not in picture.details()


def test_workload_facts_are_written_whole() -> None:
    facts = WorkloadFacts(kind="training", frozen_share=None, graph_kept=False, mixed_precision_on=None, gpus=2,
                          summary="training, 2 GPUs")
    assert facts.to_json() == {"kind": "training", "frozen_share": None, "graph_kept": False,
                               "mixed_precision_on": None, "gpus": 2, "summary": "training, 2 GPUs"}


@pytest.mark.parametrize(("path", "why"), [
    ("sim/leak.pickle", "the ring buffer wrapped or recording started late"),
    ("kineto/train.memory_timeline.json.gz", "torch's memory profiler lists them as existing before the profiled steps"),
    ("kineto/train.pt.trace.json.gz", PROFILED_LATE[0]),
])
def test_the_reader_says_why_memory_was_alive_before_the_recording(path: str, why: str) -> None:
    """The pipeline's warning reads this capability, not the format's name."""
    trace = analyzer.load(FIXTURES / path)
    assert (trace.alive_before or PROFILED_LATE)[0] == why


FINDINGS = result.Finding.__subclasses__()


def test_every_finding_kind_has_one_class_that_writes_every_field_once() -> None:
    assert sorted(k.KIND.value for k in FINDINGS) == sorted(k.value for k in FindingKind)
    for kind in FINDINGS:
        fields = [f.name for f in dataclasses.fields(kind)]
        assert kind.JSON_KEYS[0] == "kind" and sorted(kind.JSON_KEYS[1:]) == sorted(fields), kind.__name__


@pytest.mark.parametrize("kind", FINDINGS, ids=lambda k: k.__name__)
def test_no_finding_or_its_details_is_an_untyped_bag(kind: type) -> None:
    details = typing.get_args(kind.__orig_bases__[0])[0]   # Finding[OomDetails] -> OomDetails
    for typed in (kind, details):
        untyped = [f"{f.name}: {f.type}" for f in dataclasses.fields(typed) if "Any" in str(f.type)]
        assert not untyped, typed.__name__


def test_a_finding_writes_the_analyzer_1_keys_in_their_order() -> None:
    """The leak's keys (its summary before its bytes) and the fragmentation's (its recoverable bytes last), as the
    contract has written them since analyzer/1; the evidence leaves out what a finding has none of."""
    leak = next(f for f in analyzer.analyze(FIXTURES / "sim" / "leak.pickle").devices[0].diagnosis.findings
                if isinstance(f, result.LeakFinding))
    written = leak.to_json()
    assert list(written) == ["kind", "severity", "summary", "bytes", "bytes_per_step", "steps_to_oom", "oom_step",
                             "stacks", "stack_count", "evidence"]
    assert written["kind"] == "leak" and type(written["kind"]) is str
    assert list(written["evidence"]) == ["event_index", "allocations", "details"]
    assert list(written["evidence"]["details"]) == ["measured_steps", "levels", "level_growth_per_step",
                                                    "capacity_bytes", "largest_step_peak_bytes"]
    picture = FragmentationPicture(event_index=3, reserved_bytes=10, allocated_bytes=6, inactive_bytes=4,
                                   internal_bytes=1, external_bytes=2, cached_free_segments_bytes=0,
                                   largest_free_block_bytes=1, request_bytes=None, expandable_segments=None,
                                   segments_recorded=True, segments=[FreeInSegment(0, 10, 6, 4, 4)])
    found = result.FragmentationFinding(severity="warning", bytes=2, summary="s", recoverable_bytes=2,
                                        evidence=result.Evidence(event_index=[3, 3],
                                                                 details=result.FragmentationDetails(picture)))
    assert list(found.to_json()) == ["kind", "severity", "bytes", "summary", "evidence", "recoverable_bytes"]
    assert found.to_json()["evidence"] == {"event_index": [3, 3], "details": picture.details()}
    assert result.first_of([found], result.LeakFinding) is None
    assert result.first_of([leak, found], result.FragmentationFinding) is found
