"""Kineto traces and export_memory_timeline files: the real GPU recordings in ../shared/real, the CPU fixtures
of scripts/record_kineto_fixtures.py, and small synthetic traces for the edge cases.

Every expected figure on a real file is computed here from the JSON alone (json, gzip, tarfile), never with
analyzer code, so agreement means something.
"""
from __future__ import annotations

import gzip
import json
import tarfile
from functools import lru_cache
from itertools import accumulate
from pathlib import Path

import pytest

from analyzer.core.timeline import find_peak
from analyzer.core.trace import MemoryTrace, MultiRankTrace
from analyzer.errors import CorruptInput
from analyzer.ingest import kineto, load
from analyzer.ingest.kineto import HOST, SPAN_COLUMNS, read_kineto
from analyzer.ingest.memory_timeline import read_memory_timeline
from support.paths import FIXTURES

KINETO_FIXTURES = FIXTURES / "kineto"
WITH_TOTALS = ["hta/df_index_resolver.json.gz", "tracelens/Qwen_Qwen1.5-0.5B-Chat__1016005.json.gz",
               "tracelens/gaunernst_bert-small-uncased__1016001.json.gz",
               "tracelens-mi300/gaunernst_bert-small-uncased__1016001.json.gz"]
LEGACY = ["kineto-tb_plugin/resnet50_num_workers_0/worker0.1623143089861.pt.trace.json.gz",
          "kineto-tb_plugin/resnet50_num_workers_0/worker0.1623143566756.pt.trace.json.gz",
          "kineto-tb_plugin/resnet50_num_workers_4/worker0.1623212756351.pt.trace.json.gz"]
NO_MEMORY = ["hta/rank0.json.gz", "hta/sampled_rank-0.json.gz", "hta/sampled_rank-1.json.gz",
             "hta/rank-34.Jul_15_10_52_41.1074.pt.trace.json.gz", "tracelens/eager_trace.json.gz",
             "tracelens-mi300/resnet_act_checkpoint.json.gz", "param/dlrm_kineto.tar.gz"]
TIMELINES = ["hta/memory_timeline.raw.gz", "cwilson51-colloquium/train_batch_128_nworkers_6_memory_broken.json"]
HOST_TYPES = {0, 2, 5}  # c10 CPU, MKLDNN, IDEEP
RECORD = "torch.profiler.profile(profile_memory=True, record_shapes=True, with_stack=True)"


@lru_cache(maxsize=None)
def loaded(path: Path) -> MemoryTrace | MultiRankTrace:
    return load(path)


def read_json(path: Path):
    with open(path, "rb") as f:
        opener = gzip.open if f.read(2) == b"\x1f\x8b" else open
    with opener(path, "rb") as f:
        return json.load(f)


def gpu_memory_args(path: Path) -> dict[int, list[dict]]:
    """Per GPU device, the args of its [memory] events in time order (file order among equal times)."""
    events = [e for e in read_json(path)["traceEvents"] if e.get("name") == "[memory]"]
    by_device: dict[int, list[dict]] = {}
    for e in sorted(events, key=lambda e: e["ts"]):
        if e["args"]["Device Type"] not in HOST_TYPES:
            by_device.setdefault(e["args"]["Device Id"], []).append(e["args"])
    return by_device


def after_memory_events(trace: MemoryTrace, device: int):
    """Timeline rows just after each alloc/free event of `device`, in order."""
    tl = trace.timeline
    events = trace.events[(trace.events["device"] == device)
                          & trace.events["action"].isin(["alloc", "free_completed"])]
    rows = tl[(tl["device"] == device) & tl["seq"].isin(events["seq"])]
    return rows.sort_values("seq")


def real_kineto_inputs() -> list[str]:
    return WITH_TOTALS + LEGACY + NO_MEMORY + ["kineto-tb_plugin/resnet50_num_workers_0"]


# ---- real GPU recordings ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", real_kineto_inputs())
def test_every_real_trace_loads_with_reserved_at_least_allocated(real_dir, name):
    result = loaded(real_dir / name)
    traces = result.traces if isinstance(result, MultiRankTrace) else [result]
    for trace in traces:
        tl = trace.timeline
        assert (tl["reserved_bytes"] >= tl["allocated_bytes"]).all()
        assert list(trace.spans.columns) == list(SPAN_COLUMNS)
        assert trace.event_threads.index.equals(trace.events.index)


@pytest.mark.parametrize("name", WITH_TOTALS)
def test_replayed_allocated_equals_total_allocated_at_every_event(real_dir, name):
    trace = loaded(real_dir / name)
    for device, args in gpu_memory_args(real_dir / name).items():
        totals = [a["Total Allocated"] for a in args]
        replay = after_memory_events(trace, device)["allocated_bytes"].tolist()
        assert replay == totals
        assert find_peak(trace, device).allocated_bytes == max(totals)


@pytest.mark.parametrize("name", WITH_TOTALS)
def test_reserved_timeline_equals_total_reserved(real_dir, name):
    trace = loaded(real_dir / name)
    tl = trace.timeline
    for device, args in gpu_memory_args(real_dir / name).items():
        assert after_memory_events(trace, device)["reserved_bytes"].tolist() == [a["Total Reserved"] for a in args]
        assert tl.loc[tl["device"] == device, "reserved_bytes"].max() == max(a["Total Reserved"] for a in args)


def test_rank_and_device_properties(real_dir):
    for name, rank, world in [("hta/df_index_resolver.json.gz", 1, 2), ("hta/rank0.json.gz", 0, 16),
                              ("hta/sampled_rank-0.json.gz", 0, 128), ("hta/sampled_rank-1.json.gz", 1, 128),
                              ("hta/rank-34.Jul_15_10_52_41.1074.pt.trace.json.gz", 34, 300)]:
        trace = loaded(real_dir / name)
        info = read_json(real_dir / name)["distributedInfo"]
        assert (trace.rank, trace.world_size) == (rank, world) == (info["rank"], info["world_size"])
    a100 = loaded(real_dir / "hta/rank0.json.gz").devices
    assert [(d.name, d.capacity_bytes) for d in a100.values()] == [("NVIDIA A100-SXM4-80GB", 84990623744)]
    v100 = loaded(real_dir / "hta/df_index_resolver.json.gz").devices[1]
    assert (v100.name, v100.capacity_bytes) == ("Tesla V100-SXM2-32GB", 34089730048)
    assert loaded(real_dir / "hta/rank-34.Jul_15_10_52_41.1074.pt.trace.json.gz").devices == {}


def test_multi_rank_archive(real_dir):
    path = real_dir / "param/dlrm_kineto.tar.gz"
    with tarfile.open(path) as archive:
        expected = sorted(json.load(archive.extractfile(m))["distributedInfo"]["rank"]
                          for m in archive.getmembers() if m.isfile())
    ranks = loaded(path)
    assert ranks.ranks == expected == list(range(8))
    assert {t.world_size for t in ranks.traces} == {8}
    assert all(t.source_path.startswith(f"{path}!") for t in ranks.traces)


def test_traces_without_memory_events_say_how_to_record(real_dir):
    trace = loaded(real_dir / "hta/rank0.json.gz")
    assert not trace.has_history and len(trace.allocations) == 0
    assert any(RECORD in w for w in trace.warnings)
    assert trace.timeline["allocated_bytes"].max() == 0
    assert trace.annotations["name"].str.startswith("ProfilerStep#").any()


@pytest.mark.parametrize("name", LEGACY)
def test_2021_traces_rebuild_totals_by_summing(real_dir, name):
    trace = loaded(real_dir / name)
    assert "2021" in trace.torch_era
    for device, args in gpu_memory_args(real_dir / name).items():
        sums = list(accumulate(a["Bytes"] for a in args))
        start = -min(0, *sums)
        assert find_peak(trace, device).allocated_bytes == start + max(sums)
        assert trace.timeline.loc[trace.timeline["device"] == device, "allocated_bytes"].iloc[-1] == start + sums[-1]
    assert trace.annotations["name"].str.startswith("Optimizer.step#").any()


def test_amd_memory_stays_on_the_gpu(real_dir):
    trace = loaded(real_dir / "tracelens-mi300/gaunernst_bert-small-uncased__1016001.json.gz")
    gpu = trace.allocations[trace.allocations["device"] == 0]
    assert len(gpu) > 100 and "MI300" in trace.devices[0].name
    assert set(trace.devices) == {HOST, 0}
    assert trace.allocations.loc[trace.allocations["device"] == HOST, "allocated_bytes"].sum() < 1024


def test_python_stacks_and_module_spans(real_dir):
    trace = loaded(real_dir / "tracelens/Qwen_Qwen1.5-0.5B-Chat__1016005.json.gz")
    gpu = trace.allocations[trace.allocations["device"] == 0]
    assert gpu["stack_id"].notna().mean() > 0.9
    frames = {f for stack in trace.stacks["frames"] for f in stack}
    assert ("transformers/models/qwen2/modeling_qwen2.py", 503, "forward") in frames
    assert trace.spans["name"].astype(str).str.startswith("nn.Module: Qwen2DecoderLayer_").any()


def test_memory_timeline_raw_categories(real_dir):
    rows = read_json(real_dir / TIMELINES[0])
    trace = loaded(real_dir / TIMELINES[0])
    levels = list(accumulate(r[2] for r in rows))
    assert trace.timeline["allocated_bytes"].max() == max(levels)
    names = ["parameter", "optimizer_state", "input", "temporary", "activation", "gradient", "autograd_detail",
             "unattributed"]
    a = trace.allocations
    alive = a[a["t_free_us"].isna()].groupby("category", observed=True)["allocated_bytes"].sum()
    for index, name in enumerate(names):
        assert alive.get(name, 0) == sum(r[2] for r in rows if r[3] == index)
    assert set(a.loc[a["category"] != "unattributed", "label_source"]) == {"torch_memory_profiler"}
    assert (a["t_alloc_us"].isna()).sum() >= sum(1 for r in rows if r[1] == 1)


def test_memory_timeline_curve(real_dir):
    times, sizes = read_json(real_dir / TIMELINES[1])
    trace = loaded(real_dir / TIMELINES[1])
    peak = find_peak(trace, 0)
    top = max(range(len(sizes)), key=lambda i: sum(sizes[i]))
    assert peak.allocated_bytes == sum(sizes[top])
    by_category = peak.live.groupby("category", observed=True)["allocated_bytes"].sum()
    assert by_category.get("activation", 0) == sizes[top][5] and by_category.get("gradient", 0) == sizes[top][6]


# ---- CPU fixtures of scripts/record_kineto_fixtures.py -------------------------------------------------------
def test_fixture_training_trace():
    path = KINETO_FIXTURES / "train.pt.trace.json.gz"
    trace = loaded(path)
    assert set(trace.devices) == {HOST} and trace.has_history
    names = set(trace.annotations["name"])
    assert {"ProfilerStep#2", "ProfilerStep#3", "Optimizer.step#Adam.step"} <= names
    spans = trace.spans["name"].astype(str)
    assert spans.str.startswith("autograd::engine::evaluate_function").any()
    assert spans.str.startswith("nn.Module: TinyBlock_").any()
    frames = {f[0].rsplit("/", 1)[-1] for stack in trace.stacks["frames"] for f in stack}
    assert "record_kineto_fixtures.py" in frames
    totals = [e["args"]["Total Allocated"] for e in read_json(path)["traceEvents"] if e.get("name") == "[memory]"]
    assert find_peak(trace, HOST).allocated_bytes == max(totals)


def test_fixture_scenarios():
    accumulation = loaded(KINETO_FIXTURES / "grad_accum.pt.trace.json.gz").spans["name"].astype(str)
    assert (accumulation == "nn.Module: Sequential_0").sum() == 2 * 2  # two micro-batches in each active step
    assert "checkpoint" in set(loaded(KINETO_FIXTURES / "checkpoint.pt.trace.json.gz").annotations["name"])


def test_fixture_memory_timeline_categories():
    raw_path = KINETO_FIXTURES / "train.memory_timeline.raw.json.gz"
    rows = read_json(raw_path)
    raw = read_memory_timeline(raw_path)
    assert {"parameter", "optimizer_state", "gradient", "activation"} <= set(raw.allocations["category"])
    assert raw.timeline["allocated_bytes"].max() == max(accumulate(r[2] for r in rows))
    curve_path = KINETO_FIXTURES / "train.memory_timeline.json.gz"
    times, sizes = read_json(curve_path)
    curve = read_memory_timeline(curve_path)
    assert curve.timeline["allocated_bytes"].max() == max(map(sum, sizes))
    assert curve.timeline["allocated_bytes"].max() <= raw.timeline["allocated_bytes"].max()


def _steps_of_memory_timeline(path: Path, active: int) -> None:
    """A memory timeline has no step marks: the phase cycle of torch's categories (activations made in forward,
    gradients in backward) numbers the profiler's active steps; tensors alive before it get no phase."""
    from analyzer.attribute import attribute

    a = attribute(read_memory_timeline(path)).allocations
    timed = a["t_alloc_us"].notna()
    assert sorted(a.loc[timed, "step"].unique()) == list(range(1, active + 1)), path
    assert (a.loc[timed & (a["category"] == "activation"), "phase"] == "forward").all()
    assert (a.loc[timed & (a["category"] == "gradient"), "phase"] == "backward").all()
    assert (a.loc[~timed, "phase"] == "unattributed").all() and a.loc[~timed, "step"].isna().all()


@pytest.mark.parametrize("name", ["train.memory_timeline.raw.json.gz", "train.memory_timeline.json.gz"])
def test_fixture_memory_timeline_steps_from_torchs_categories(name):
    _steps_of_memory_timeline(KINETO_FIXTURES / name, active=2)   # scripts/record_kineto_fixtures.py: ACTIVE


def test_real_memory_timeline_steps_from_torchs_categories(real_dir):
    _steps_of_memory_timeline(real_dir / TIMELINES[1], active=10)  # TRUTH.md: the schedule's active=10


# ---- synthetic traces: formats and edges ---------------------------------------------------------------------
def memory(ts, nbytes, allocated, reserved, addr=None, device=0, name="[memory]"):
    args = {"Device Type": 1, "Device Id": device, "Bytes": nbytes, "Total Allocated": allocated,
            "Total Reserved": reserved}
    if addr is not None:
        args["Addr"] = addr
    return {"ph": "i", "cat": "cpu_instant_event", "name": name, "pid": 1, "tid": 7, "ts": ts, "args": args}


def write(path: Path, document, compress: bool = False) -> Path:
    data = json.dumps(document).encode()
    path.write_bytes(gzip.compress(data) if compress else data)
    return path


def test_reserved_shrinks_and_oom(tmp_path):
    events = [memory(10, 100, 600, 1000, addr=1), memory(20, 300, 900, 2000, addr=2),
              memory(30, -300, 600, 1200, addr=2), memory(40, 50, 650, 1200, addr=3),
              memory(45, 4096, 650, 1200, name="[OutOfMemory]")]
    trace = load(write(tmp_path / "t.json", {"traceEvents": events}))
    after = after_memory_events(trace, 0)
    assert after["allocated_bytes"].tolist() == [600, 900, 600, 650]
    assert after["reserved_bytes"].tolist() == [1000, 2000, 1200, 1200]
    segments = trace.segments
    assert segments.loc[segments["alive_at_end"], "bytes"].sum() == 1200
    assert segments.loc[~segments["alive_at_end"], "bytes"].sum() == 800
    assert trace.ooms["requested_bytes"].tolist() == [4096]
    assert (trace.allocations["origin"] == "end_state").sum() == 1  # the 500 bytes alive before the window


def test_metadata_after_events_and_tricky_names(tmp_path):
    document = {"traceEvents": [{"ph": "X", "cat": "user_annotation", "name": 'x}], "traceName": "no"}',
                                 "ts": 5, "dur": 10, "tid": 7, "args": {"a": [{"b": 1}]}},
                                memory(8, 64, 64, 128, addr=9)],
                "deviceProperties": [{"id": 0, "name": "G", "totalGlobalMem": 5 << 30}],
                "distributedInfo": {"rank": 3, "world_size": 4}, "baseTimeNanoseconds": 1_000_000_000_500}
    trace = load(write(tmp_path / "t.json.gz", document, compress=True))
    assert (trace.rank, trace.world_size) == (3, 4)
    assert (trace.devices[0].name, trace.devices[0].capacity_bytes) == ("G", 5 << 30)
    assert trace.events["t_us"].iloc[-1] == 1_000_000_000 + 8
    assert trace.annotations["name"].tolist() == ['x}], "traceName": "no"}']


def test_metadata_by_tokens_when_edges_are_short(real_dir, monkeypatch):
    name = "tracelens/gaunernst_bert-small-uncased__1016001.json.gz"
    fast = load(real_dir / name)
    monkeypatch.setattr(kineto, "_HEAD_BYTES", 16)
    monkeypatch.setattr(kineto, "_TAIL_BYTES", 16)
    slow = load(real_dir / name)
    assert slow.devices == fast.devices and slow.events.equals(fast.events)
    assert load(real_dir / "hta/sampled_rank-1.json.gz").rank == 1


def test_directory_of_ranks(tmp_path):
    for rank in (1, 0):
        write(tmp_path / f"rank{rank}.json", {"distributedInfo": {"rank": rank, "world_size": 2},
                                              "traceEvents": [memory(1, 8, 8, 16, addr=1)]})
    (tmp_path / "notes.txt").write_text("not a trace")
    ranks = load(tmp_path)
    assert ranks.ranks == [0, 1]
    assert any("notes.txt" in w for w in ranks.warnings)


@pytest.mark.parametrize("content", [b'{"traceEvents": [{"name": "a"},', b'{"traceEvents": [1, 2]}',
                                     b'{"schemaVersion": 1}', b'{"traceEvents": [{"name": "[memory]", "args": {}}]}'])
def test_bad_traces_raise_one_corrupt_input(tmp_path, content):
    path = tmp_path / "bad.json"
    path.write_bytes(content)
    with pytest.raises(CorruptInput, match="bad.json"):
        load(path)


def test_truncated_gzip_and_wrong_top_level(tmp_path, real_dir):
    data = (real_dir / "tracelens/gaunernst_bert-small-uncased__1016001.json.gz").read_bytes()
    truncated = tmp_path / "cut.json.gz"
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptInput, match="cut.json.gz"):
        load(truncated)
    for document in ([1, 2, 3], "text"):
        with pytest.raises(CorruptInput, match="list.json"):
            read_kineto(write(tmp_path / "list.json", document))
    with pytest.raises(CorruptInput, match="object.json"):
        read_memory_timeline(write(tmp_path / "object.json", {"traceEvents": []}))


# ---- the cuBLAS workspace alive before a trace ----------------------------------------------------------------
MiB = 1 << 20
WEIGHTS = 100 * MiB
SM90_WORKSPACE, WORKSPACE = 32 * MiB, 8 * MiB + 128 * 1024   # torch's defaults (CublasHandlePool.cpp)
CUBLAS_KERNEL = "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64_execute_segment_k_off_kernel__5x_cublas"


def _workspace_trace(tmp_path: Path, capability=(9, 0), kernel=CUBLAS_KERNEL, before=WEIGHTS + SM90_WORKSPACE,
                     made=MiB, device_type=1) -> MemoryTrace:
    """An inference window on one GPU: `before` bytes alive when it opens, one `made`-byte tensor, one kernel."""
    events = [memory(10, made, before + made, 2 * before, addr=1), memory(30, -made, before, 2 * before, addr=1),
              {"ph": "X", "cat": "kernel", "name": kernel, "ts": 20, "dur": 5, "pid": 0, "tid": 7,
               "args": {"device": 0}}]
    for e in events[:2]:
        e["args"]["Device Type"] = device_type
    document = {"traceEvents": events,
                "deviceProperties": [{"id": 0, "name": "G", "totalGlobalMem": 80 << 30,
                                      "computeMajor": capability[0], "computeMinor": capability[1]}]}
    trace = load(write(tmp_path / "t.json", document))
    assert isinstance(trace, MemoryTrace)
    return trace


def _before(trace: MemoryTrace) -> list[int]:
    a = trace.allocations
    return sorted(a.loc[a["origin"].astype(str) == "end_state", "requested_bytes"].tolist())


@pytest.mark.parametrize("capability, size", [((9, 0), SM90_WORKSPACE), ((8, 0), WORKSPACE)])
def test_the_cublas_workspace_that_predates_a_trace_is_set_apart_and_other(tmp_path, capability, size):
    from analyzer.pipeline import analyze
    trace = _workspace_trace(tmp_path, capability, before=WEIGHTS + size)
    assert _before(trace) == sorted([size, WEIGHTS]) and trace.devices[0].workspace_before_bytes == size
    analysis = analyze(trace)
    a = analysis.trace.allocations
    workspace = a[(a["origin"].astype(str) == "end_state") & (a["requested_bytes"] == size)]
    assert workspace["category"].astype(str).tolist() == ["other"]
    assert workspace["label_source"].astype(str).str.contains("category=structure:blas-workspace-size").all()
    assert workspace["phase"].astype(str).tolist() == ["unattributed"]   # not loaded: some earlier matmul made it
    assert {r["name"]: r["bytes"] for r in analysis.devices[0].by_category}["other"] == size


@pytest.mark.parametrize("why, kwargs", [
    ("no cuBLAS kernel ran", {"kernel": "void at::native::vectorized_elementwise_kernel<4>"}),
    ("the trace made a tensor of the workspace's size", {"made": SM90_WORKSPACE}),
    ("a GPU whose default differs between torch versions", {"capability": (10, 0)}),
    ("ROCm sizes its workspace otherwise", {"device_type": 6}),
    ("less was alive before than a workspace", {"before": SM90_WORKSPACE - MiB}),
])
def test_nothing_is_set_apart_without_the_evidence(tmp_path, why, kwargs):
    trace = _workspace_trace(tmp_path, **kwargs)
    assert len(_before(trace)) == 1 and trace.devices[0].workspace_before_bytes is None, why


def test_a_trace_without_a_running_total_says_what_lived_before_is_not_recorded(real_dir, tmp_path):
    assert not load(real_dir / LEGACY[0]).devices[0].before_recorded
    assert _workspace_trace(tmp_path).devices[0].before_recorded


def _device_verdict(trace: MemoryTrace) -> str:
    from analyzer.pipeline import analyze
    result = analyze(trace)
    return next(d["verdict"] for d in result.to_json()["devices"] if d["device"] == 0)


def test_a_peak_without_what_lived_before_is_said_to_be_a_lower_bound(tmp_path):
    without = [dict(memory(t, n, 0, 0, addr=a)) for t, n, a in ((10, MiB, 1), (20, 2 * MiB, 2), (30, -MiB, 1))]
    for e in without:
        del e["args"]["Total Allocated"], e["args"]["Total Reserved"]
    legacy = load(write(tmp_path / "legacy.json", {"traceEvents": without}))
    assert isinstance(legacy, MemoryTrace) and not legacy.devices[0].before_recorded
    assert _device_verdict(legacy).endswith("every peak here is a lower bound.")
    assert "lower bound" not in _device_verdict(_workspace_trace(tmp_path))
