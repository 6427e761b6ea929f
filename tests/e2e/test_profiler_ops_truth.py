"""Attribution of a profiler trace from what ran (ops, nn.Module spans, backward nodes, steps) against torch's
own memory profiler for the same run, joined per allocation by address, size and time (support.profiled_run),
and on every real profiler trace with memory events in ../shared/real."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

import analyzer
from analyzer.ingest.memory_timeline import AS_OUR_CATEGORY
from support.paths import REAL
from support.profiled_run import aligned, record


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[analyzer.Analysis, pd.DataFrame]:
    pytest.importorskip("torch")
    trace, truth = record(tmp_path_factory.mktemp("profiled"))
    result = analyzer.analyze(trace)
    assert isinstance(result, analyzer.Analysis)
    return result, truth


def _agreement(rows: pd.DataFrame, truth: pd.DataFrame) -> tuple[float, pd.DataFrame]:
    made = rows[rows["t_alloc_us"].notna()]
    ours = pd.DataFrame({"addr": made["addr"].to_numpy(), "t_us": made["t_alloc_us"].astype("int64").to_numpy(),
                         "bytes": made["requested_bytes"].to_numpy(), "ours": made["category"].astype(str).to_numpy(),
                         "phase": made["phase"].astype(str).to_numpy(), "weight": made["allocated_bytes"].to_numpy()})
    joined = aligned(ours, truth)
    joined["agrees"] = joined["ours"] == joined["torch"].replace(AS_OUR_CATEGORY)
    return float(joined.loc[joined["agrees"], "weight"].sum() / joined["weight"].sum()), joined


def test_categories_agree_with_torch_at_the_peak(run) -> None:
    result, truth = run
    share, joined = _agreement(result.devices[0].peak.live, truth)
    print(f"peak: {share:.4f} of {joined['weight'].sum()} bytes scored")
    assert len(joined) >= 10
    assert share >= 0.95


def test_categories_agree_with_torch_over_the_recording(run) -> None:
    """Where torch and we part over the recording: the Adam step's `exp_avg_sq.sqrt()` and its division, made
    and freed inside the step (our temporaries), which torch's data-flow flood calls activation and parameter."""
    result, truth = run
    share, joined = _agreement(result.trace.allocations, truth)
    outside_step = joined[joined["phase"] != "optimizer"]
    rest = float(outside_step.loc[outside_step["agrees"], "weight"].sum() / outside_step["weight"].sum())
    print(f"recording: {share:.4f} of {joined['weight'].sum()} bytes; outside the optimizer step {rest:.4f}")
    assert rest >= 0.99
    assert share >= 0.85
    disagreeing = joined[~joined["agrees"]]
    assert set(disagreeing.loc[disagreeing["weight"] > 1024, "phase"]) <= {"optimizer"}


def test_phases_modules_and_steps_come_from_what_ran(run) -> None:
    result, _ = run
    a = result.trace.allocations
    made = a[a["t_alloc_us"].notna()]
    sources = made["label_source"].astype(str)
    assert sources.str.contains("phase=ops:autograd-engine").any()
    assert sources.str.contains("module=ops:nn.Module").any() or sources.str.contains("module=frames").any()
    assert set(made["step"].dropna().astype(int)) == {1, 2, 3}
    backward = made[made["phase"].astype(str) == "backward"]
    linked = backward[backward["label_source"].astype(str).str.contains("module=ops:sequence-number")]
    assert len(linked) and linked["module"].astype(str).str.contains("Linear_").any()
    ops = result.trace.stacks["op"].dropna()
    assert ops.str.match(r"^aten::addmm\(float\[\d+(, \d+)*\]").any()


# ---- real traces -----------------------------------------------------------------------------------------
#: every real profiler trace with memory events: measured share of the peak with a phase, and with a category,
#: of all the peak's bytes and of those the trace saw made or freed (memory alive through the whole window was
#: made before the profiler started; in a trace that trains, nothing in it says what that memory is)
REAL_TRACES = {
    "hta/df_index_resolver.json.gz": 1,
    "kineto-tb_plugin/resnet50_num_workers_0/worker0.1623143089861.pt.trace.json.gz": 0,
    "kineto-tb_plugin/resnet50_num_workers_0/worker0.1623143566756.pt.trace.json.gz": 0,
    "kineto-tb_plugin/resnet50_num_workers_4/worker0.1623212756351.pt.trace.json.gz": 0,
    "tracelens/Qwen_Qwen1.5-0.5B-Chat__1016005.json.gz": 0,
    "tracelens/gaunernst_bert-small-uncased__1016001.json.gz": 0,
    "tracelens-mi300/gaunernst_bert-small-uncased__1016001.json.gz": 0,
}


def peak_shares(path: Path, device: int) -> dict[str, float]:
    result = analyzer.analyze(path)
    assert isinstance(result, analyzer.Analysis)
    live = result.device(device).peak.live
    weight = live["allocated_bytes"].to_numpy(dtype=np.float64)
    seen = (live["origin"].astype(str) != "end_state").to_numpy()
    out = {}
    for field in ("phase", "category"):
        known = (live[field].astype(str) != "unattributed").to_numpy()
        out[field] = float(weight[known].sum() / weight.sum())
        out[f"{field}_seen"] = float(weight[known & seen].sum() / weight[seen].sum())
    return out


@pytest.mark.parametrize("name", list(REAL_TRACES))
def test_real_trace_peaks_are_attributed(name: str) -> None:
    if not REAL.is_dir():
        pytest.skip(f"real recordings not found at {REAL}")
    shares = peak_shares(REAL / name, REAL_TRACES[name])
    print(name, {k: round(v, 3) for k, v in shares.items()})
    assert shares["phase_seen"] >= 0.90
    assert shares["category_seen"] >= 0.80
