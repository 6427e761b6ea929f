"""A Kineto trace of a LoRA fine-tune names the memory alive before it as the frozen base's parameters (issue 32,
"Model states that still slip"): rule 6 of analyzer.attribute.model_states, on both sides of FROZEN_LUMP_SHARE.

The recording is fixtures/traces/kineto/lora.pt.trace.json.gz (scripts/record_kineto_fixtures.py `lora`: rank-4
adapters beside every nn.Linear of a frozen base made before the profiler started, Adam over the adapters only,
zero_grad(set_to_none=True)), recorded on the CPU. The CPU profiler's running total starts at the window, so the
trace is moved here to cuda:0 as a GPU records it: every [memory] event's Total Allocated gains the bytes alive
before the window (Total Reserved is their running maximum, a caching allocator that keeps what it got)."""
from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pytest

import analyzer
from analyzer.ingest.kineto import read_kineto
from analyzer.result import Analysis
from support.paths import REAL, ROOT

LORA = ROOT / "fixtures" / "traces" / "kineto" / "lora.pt.trace.json.gz"
BASE, ADAPTERS = 419_112, 23_712   # fp32 bytes of the frozen base's and the adapters' parameters (the script's model)
MOMENTS = 2 * ADAPTERS             # Adam's exp_avg and exp_avg_sq of the adapters, made before the window
FROZEN_LUMP_SHARE, ADAM_MOMENTS = 0.5, 2   # model_states.FROZEN_LUMP_SHARE, ADAM_MOMENTS


def _on_gpu(tmp_path: Path, before: int, **options: Any) -> Analysis:
    trace = json.loads(gzip.decompress(LORA.read_bytes()))
    high = 0
    for event in trace["traceEvents"]:
        if event.get("name") == "[memory]" and event["args"].get("Device Type") == 0:
            args = event["args"]
            args["Device Type"], args["Device Id"] = 1, 0
            args["Total Allocated"] += before
            high = max(high, args["Total Allocated"])
            args["Total Reserved"] = high
    path = tmp_path / "lora_gpu.pt.trace.json"
    path.write_text(json.dumps(trace))
    return analyzer.analyze(read_kineto(path), **options)


def _before(analysis: Analysis) -> tuple[str | None, str]:
    a = analysis.trace.allocations
    row = a[(a["origin"] == "end_state") & (a["device"] == 0)].iloc[0]
    return (None if str(row["category"]) == "unattributed" else str(row["category"])), str(row["label_source"])


def test_a_lora_runs_memory_from_before_the_trace_is_its_frozen_base(tmp_path):
    """Alive before the window: the base, the adapters and Adam's moments of them (490,248 B). The adapters'
    gradients one step makes are 23,712 B; with two moments 71,136 B, under half of it: parameters, at the peak
    too, within the adapters' moments (10.7%) of the true 442,824 B of parameters."""
    before = BASE + ADAPTERS + MOMENTS
    analysis = _on_gpu(tmp_path, before)
    assert _before(analysis) == ("parameter", "phase=none;category=structure:frozen-base-before-trace;module=none")
    device = next(d for d in analysis.devices if d.device == 0)
    at_peak = {r["name"]: r["bytes"] for r in device.by_category}
    assert at_peak["gradient"] <= ADAPTERS and at_peak["parameter"] == before
    assert at_peak["parameter"] / (BASE + ADAPTERS) - 1 == pytest.approx(MOMENTS / (BASE + ADAPTERS))


@pytest.mark.parametrize(("before", "named"), [
    (int((1 + ADAM_MOMENTS) * ADAPTERS / FROZEN_LUMP_SHARE) + 8, True),
    (int((1 + ADAM_MOMENTS) * ADAPTERS / FROZEN_LUMP_SHARE), False)], ids=["just over six gradients", "six"])
def test_the_amount_is_parameters_only_where_the_trainable_part_is_under_half_of_it(tmp_path, before, named):
    """A full fine-tune's amount holds its parameters and Adam's moments (three gradients' worth): from six
    gradients' worth (the trainable part half of it) it stays unattributed."""
    category, _ = _before(_on_gpu(tmp_path, before))
    assert (category == "parameter") is named and (category is None) is (not named)


def test_the_frozen_lump_share_is_a_threshold_of_the_python_api(tmp_path):
    """Six gradients' worth (the trainable part with Adam's moments exactly half the amount) stays open at the
    default half, and is a frozen base at a share tuned to 0.51."""
    assert analyzer.Thresholds().frozen_lump_share == FROZEN_LUMP_SHARE
    six = int((1 + ADAM_MOMENTS) * ADAPTERS / FROZEN_LUMP_SHARE)
    tuned = _on_gpu(tmp_path, six, thresholds=analyzer.Thresholds(frozen_lump_share=0.51))
    assert _before(tuned) == ("parameter", "phase=none;category=structure:frozen-base-before-trace;module=none")


def test_a_backward_that_made_no_gradient_leaves_the_amount_open():
    """HTA's df_index_resolver (rank 1 of a training job, V100) runs backwards that make no gradient: they were
    alive before the window and accumulated in place, so its 4.09 GB alive before hold them too: not a frozen base."""
    path = REAL / "hta" / "df_index_resolver.json.gz"
    if not path.exists():
        pytest.skip(f"{path} is absent (the real recordings live in ../shared/real)")
    a = analyzer.analyze(path).trace.allocations
    lump = a[(a["origin"] == "end_state") & (a["device"] == 1) & (a["allocated_bytes"] > 2**30)]
    assert len(lump) == 1 and str(lump["category"].iloc[0]) == "unattributed"
    assert not ((a["category"] == "gradient") & (a["origin"] == "trace") & (a["device"] == 1)).any()
