"""Nsight Systems exports: the three real ones, the fixture of one run seen by both recorders, schema drift, bad files.

Expected numbers come from independent sqlite queries written here, or from what scripts/make_nsys_fixtures.py
planted (1.5 GiB of NCCL memory outside PyTorch, 256 MiB more for 50 ms, 512 MiB of CUDA context).
"""
from __future__ import annotations

import dataclasses
import pickle
import shutil
import sqlite3
import subprocess
import sys
from contextlib import closing
from pathlib import Path

import pytest

from analyzer.core.trace import empty_table
from analyzer.diagnose.outside_pytorch import outside_pytorch
from analyzer.errors import AnalyzerError, CorruptInput, UnsupportedFormat
from analyzer.ingest import load
from analyzer.ingest.nsys import annotation_name, decode_global_tid
from analyzer.ingest.safe_pickle import load_untrusted
from analyzer.ingest.snapshot import snapshot_to_trace
from support.paths import FIXTURES

GiB, MiB = 1 << 30, 1 << 20
NSYS = FIXTURES / "nsys"
RUN_SQLITE = NSYS / "oom_with_nccl.sqlite"
RUN_PICKLE = NSYS / "oom_with_nccl.pickle"
SESSION_START_US = 1_767_225_600_000_000      # the fixture's TARGET_INFO_SESSION_START_TIME, in µs
RANGE_OR_MARK = ("NvtxPushPopRange", "NvtxStartEndRange", "NvtxtPushPopRange", "NvtxtStartEndRange", "NvtxMark",
                 "NvtxtMark")

REAL_EXPORTS = {
    # file: (device name, total memory, memory API calls the runtime trace shows)
    "dlprof/nsys_profile.sqlite": ("NVIDIA GeForce RTX 2070 SUPER", 8368816128, "cudaFree ×4, cudaMalloc ×10"),
    "dlprof/w_Relu/nsys_profile.sqlite": ("NVIDIA GeForce RTX 2070 SUPER", 8368816128, "cudaFree ×7, cudaMalloc ×15"),
    "nvidia-fuser/report1.sqlite": ("NVIDIA H200", 150121545728, "cudaFree ×7, cudaMalloc ×11"),
}


def query(path: Path, sql: str) -> list[tuple]:
    with closing(sqlite3.connect(path)) as db:
        return db.execute(sql).fetchall()


def expected_annotation_count(path: Path) -> int:
    """Ranges and marks, by the export's own enum where it has one, else rows with an end (the only kind then)."""
    if query(path, "SELECT COUNT(*) FROM sqlite_master WHERE name = 'ENUM_NSYS_EVENT_TYPE'")[0][0]:
        names = ", ".join(f"'{n}'" for n in RANGE_OR_MARK)
        return query(path, "SELECT COUNT(*) FROM NVTX_EVENTS AS n JOIN ENUM_NSYS_EVENT_TYPE AS e ON e.id = n.eventType "
                           f"WHERE e.name IN ({names})")[0][0]
    return query(path, 'SELECT COUNT(*) FROM NVTX_EVENTS WHERE "end" IS NOT NULL')[0][0]


def variant(tmp_path: Path, *statements: str) -> Path:
    """A copy of the fixture export with some SQL applied: schema drift made to order."""
    path = tmp_path / "variant.sqlite"
    shutil.copyfile(RUN_SQLITE, path)
    with closing(sqlite3.connect(path)) as db:
        for statement in statements:
            db.execute(statement)
        db.commit()
    return path


def run_cli(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "analyzer", str(path), "--format", "json", "-q"],
                          capture_output=True, text=True, timeout=120)


# ---- the real exports ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(REAL_EXPORTS))
def test_real_export_loads(real_dir: Path, name: str) -> None:
    path = real_dir / name
    device_name, total_memory, api_calls = REAL_EXPORTS[name]
    trace = load(path)
    assert trace.source_kind == "nsys"
    assert (trace.devices[0].name, trace.devices[0].capacity_bytes) == (device_name, total_memory)
    assert len(trace.annotations) == expected_annotation_count(path)
    by_thread = dict(query(path, 'SELECT globalTid % 16777216, COUNT(*) FROM NVTX_EVENTS WHERE "end" IS NOT NULL '
                                 "GROUP BY 1"))
    assert trace.annotations["thread"].value_counts().to_dict() == by_thread
    (first_ns, session_ns), = query(path, "SELECT MIN(start), (SELECT utcEpochNs FROM TARGET_INFO_SESSION_START_TIME) "
                                          "FROM NVTX_EVENTS")
    assert int(trace.annotations["start_us"].min()) == (first_ns + session_ns) // 1000
    kernels = query(path, "SELECT COUNT(*) FROM CUPTI_ACTIVITY_KIND_KERNEL")[0][0]
    assert (trace.kernels["kind"] == "kernel").sum() == kernels
    assert trace.allocations.empty and trace.segments.empty
    missing = next(w for w in trace.warnings if "CUDA_GPU_MEMORY_USAGE_EVENTS" in w)
    assert "nsys profile --cuda-memory-usage=true" in missing and api_calls in missing


def test_real_emit_nvtx_and_pyprof_names(real_dir: Path) -> None:
    path = real_dir / "dlprof/w_Relu/nsys_profile.sqlite"
    names = load(path).annotations["name"]
    aten = query(path, "SELECT COUNT(*) FROM NVTX_EVENTS WHERE text LIKE 'aten::%'")[0][0]
    assert names.str.startswith("aten::").sum() == aten
    assert not names.str.contains("seq =").any()
    assert (names == "torch.nn.functional.conv2d").sum() == 2
    assert not names.str.startswith("{'").any()


def test_real_crashed_run_says_so(real_dir: Path) -> None:
    crashed = load(real_dir / "dlprof/nsys_profile.sqlite").warnings
    assert any("RuntimeError: mat1 and mat2 shapes cannot be multiplied" in w for w in crashed)
    assert not any("exception" in w for w in load(real_dir / "dlprof/w_Relu/nsys_profile.sqlite").warnings)


@pytest.mark.parametrize("name", ["dlprof/nsys_profile.nsys-rep", "nvidia-fuser/report1.nsys-rep"])
def test_nsys_rep_asks_for_export(real_dir: Path, name: str) -> None:
    with pytest.raises(UnsupportedFormat, match="nsys export --type sqlite"):
        load(real_dir / name)
    run = run_cli(real_dir / name)
    assert run.returncode == 2 and "nsys export --type sqlite" in run.stderr and "Traceback" not in run.stderr


def test_truncated_export_is_corrupt(real_dir: Path, tmp_path: Path) -> None:
    for size in (100, 16384):
        path = tmp_path / f"cut{size}.sqlite"
        path.write_bytes((real_dir / "nvidia-fuser/report1.sqlite").read_bytes()[:size])
        with pytest.raises(CorruptInput, match="damaged or truncated"):
            load(path)
        run = run_cli(path)
        assert run.returncode == 2 and run.stderr.count("\n") == 1 and str(path) in run.stderr


# ---- bad SQLite files ------------------------------------------------------------------------------
def test_sqlite_of_another_schema(tmp_path: Path) -> None:
    path = tmp_path / "other.sqlite"
    with closing(sqlite3.connect(path)) as db:
        db.execute("CREATE TABLE users (id INTEGER, name TEXT)")
        db.commit()
    with pytest.raises(UnsupportedFormat, match="not an Nsight Systems export"):
        load(path)


def test_values_the_schema_forbids(tmp_path: Path) -> None:
    path = variant(tmp_path, "UPDATE CUDA_GPU_MEMORY_USAGE_EVENTS SET address = 'oops' WHERE rowid = 1")
    with pytest.raises(CorruptInput, match="schema does not allow"):
        load(path)


# ---- the fixture run, from Nsight's side -----------------------------------------------------------
def test_fixture_memory_is_segments() -> None:
    trace = load(RUN_SQLITE)
    assert trace.allocations.empty and any("not tensors" in w for w in trace.warnings)
    assert (trace.devices[0].name, trace.devices[0].capacity_bytes) == ("NVIDIA H100 80GB HBM3", 80 * GiB)
    assert len(trace.segments) == 7  # the pinned host buffer is not device memory
    nccl = trace.segments[trace.segments["addr"] == 0x7F00_0000_0000].iloc[0]
    assert nccl["bytes"] == 1536 * MiB and nccl["alive_at_end"]
    assert trace.events["action"].value_counts().to_dict() == {"segment_alloc": 7, "segment_free": 2}
    reserved = trace.timeline["reserved_bytes"]
    assert reserved.max() == 1536 * MiB + 2 * MiB + 8 * GiB + 20 * MiB + 12 * GiB + 24 * GiB
    assert reserved.iloc[-1] == trace.end_state(0)["reserved_bytes"]
    assert any("cudaMalloc ×2" in w and "failed" in w for w in trace.warnings)


def test_fixture_annotations() -> None:
    annotations = load(RUN_SQLITE).annotations.set_index("name")
    assert list(annotations.index) == [
        "train_step", "train_loop:load_batch", "forward", "aten::addmm", "torch.nn.functional.linear",
        "/<module>/Net::forward/Linear::forward/linear", "backward", "aten::mm", "train_loop:optimizer.step",
        "NCCL:ncclAllReduce", "checkpoint_saved"]
    assert annotations.loc["train_step", "start_us"] == SESSION_START_US + 1_250_000
    assert annotations.loc["checkpoint_saved", "end_us"] == annotations.loc["checkpoint_saved", "start_us"]
    assert annotations.loc["NCCL:ncclAllReduce", "thread"] == 4250
    assert annotations.loc["train_loop:load_batch", "thread"] == 4243


def test_fixture_gpu_activity() -> None:
    kernels = load(RUN_SQLITE).kernels
    assert kernels["kind"].value_counts().to_dict() == {"kernel": 3, "memcpy": 1, "memset": 1}
    assert kernels.loc[kernels["kind"] == "memcpy", "name"].item() == "Host-to-Device"
    assert kernels.loc[kernels["kind"] == "memcpy", "bytes"].item() == 8 * GiB


# ---- schema drift ----------------------------------------------------------------------------------
def comparable(path: Path) -> tuple:
    trace = load(path)
    return trace.segments.to_dict("list"), trace.annotations.to_dict("list"), trace.kernels.to_dict("list")


def test_drift_renamed_tables_new_columns_renumbered_enums(tmp_path: Path) -> None:
    """Old metadata name, an added column, every enum renumbered: the same trace, so no value is hard-coded."""
    path = variant(
        tmp_path,
        "ALTER TABLE META_DATA_EXPORT RENAME TO EXPORT_META_DATA",
        "ALTER TABLE CUDA_GPU_MEMORY_USAGE_EVENTS ADD COLUMN someFutureColumn INTEGER",
        "ALTER TABLE NVTX_EVENTS ADD COLUMN someFutureColumn TEXT",
        "UPDATE ENUM_CUDA_DEV_MEM_EVENT_OPER SET id = 5 - id",
        "UPDATE CUDA_GPU_MEMORY_USAGE_EVENTS SET memoryOperationType = 5 - memoryOperationType",
        "UPDATE ENUM_CUDA_MEM_KIND SET id = id + 10",
        "UPDATE CUDA_GPU_MEMORY_USAGE_EVENTS SET memKind = memKind + 10",
        "UPDATE ENUM_NSYS_EVENT_TYPE SET id = id + 100",
        "UPDATE NVTX_EVENTS SET eventType = eventType + 100",
        "UPDATE ENUM_CUDA_MEMCPY_OPER SET id = id + 10",
        "UPDATE CUPTI_ACTIVITY_KIND_MEMCPY SET copyKind = copyKind + 10",
    )
    assert comparable(path) == comparable(RUN_SQLITE)


def test_drift_without_memory_table(tmp_path: Path) -> None:
    trace = load(variant(tmp_path, "DROP TABLE CUDA_GPU_MEMORY_USAGE_EVENTS"))
    assert trace.segments.empty and not trace.has_history and len(trace.annotations) == 11
    warning = next(w for w in trace.warnings if "CUDA_GPU_MEMORY_USAGE_EVENTS" in w)
    assert "nsys profile --cuda-memory-usage=true" in warning and "cudaFree ×2, cudaMalloc ×9" in warning


def test_drift_before_event_type_enum(tmp_path: Path) -> None:
    """nsys 2022 exports have no ENUM tables: ranges are still read, marks and domain names are not."""
    trace = load(variant(tmp_path, "DROP TABLE ENUM_NSYS_EVENT_TYPE"))
    names = list(trace.annotations["name"])
    assert len(names) == 10 and "checkpoint_saved" not in names and "optimizer.step" in names
    assert any("predates ENUM_NSYS_EVENT_TYPE" in w for w in trace.warnings)


def test_drift_before_memory_operation_enum(tmp_path: Path) -> None:
    trace = load(variant(tmp_path, "DROP TABLE ENUM_CUDA_DEV_MEM_EVENT_OPER"))
    assert trace.segments.empty and any("ENUM_CUDA_DEV_MEM_EVENT_OPER" in w for w in trace.warnings)


def test_drift_normalized_timestamps(tmp_path: Path) -> None:
    """nsys export --ts-normalize=true writes epoch ns: the same epoch µs come out."""
    shift = [f'UPDATE {t} SET start = start + {SESSION_START_US * 1000}, "end" = "end" + {SESSION_START_US * 1000}'
             for t in ("NVTX_EVENTS", "CUPTI_ACTIVITY_KIND_KERNEL", "CUPTI_ACTIVITY_KIND_MEMCPY",
                       "CUPTI_ACTIVITY_KIND_MEMSET", "CUPTI_ACTIVITY_KIND_RUNTIME")]
    path = variant(tmp_path, *shift,
                   f"UPDATE CUDA_GPU_MEMORY_USAGE_EVENTS SET start = start + {SESSION_START_US * 1000}",
                   "UPDATE META_DATA_EXPORT SET value = 'true' WHERE name = 'EXPORT_PARAM_TIME_NORMALIZE'",
                   "DELETE FROM TARGET_INFO_SESSION_START_TIME")
    assert comparable(path) == comparable(RUN_SQLITE)


def test_drift_without_session_start(tmp_path: Path) -> None:
    trace = load(variant(tmp_path, "DROP TABLE TARGET_INFO_SESSION_START_TIME"))
    assert trace.annotations["start_us"].min() == 1_250_000  # train_step, 1250 ms after the capture started
    assert any("no session start time" in w for w in trace.warnings)


# ---- both recorders together -----------------------------------------------------------------------
def test_outside_pytorch_finds_the_planted_nccl_buffer() -> None:
    result = outside_pytorch(load(RUN_PICKLE), load(RUN_SQLITE))
    assert result["at"] == "oom" and result["t_us"] == SESSION_START_US + 4_000_000
    assert result["outside_bytes_at_peak"] == 1536 * MiB
    assert result["outside_bytes_max"] == 1536 * MiB + 256 * MiB
    assert result["unseen_bytes_at_oom"] == 512 * MiB
    assert result["clock_offset_us"] == -30
    assert result["device_bytes_at_peak"] - result["pytorch_reserved_bytes_at_peak"] == 1536 * MiB
    series = result["series"]
    assert (series["device_bytes"] - series["pytorch_reserved_bytes"] == series["outside_bytes"]).all()
    assert sorted(result["outside_segments"]["bytes"]) == [256 * MiB, 1536 * MiB]
    assert result["activity_at_peak"]["name"].iloc[-1] == "vectorized_elementwise_kernel"
    assert result["notes"] == []


def test_outside_pytorch_at_the_allocated_peak() -> None:
    snapshot = load(RUN_PICKLE)
    no_oom = dataclasses.replace(snapshot, ooms=empty_table("ooms"))
    result = outside_pytorch(no_oom, load(RUN_SQLITE))
    assert result["at"] == "peak" and result["t_us"] == SESSION_START_US + 3_000_001
    assert result["outside_bytes_at_peak"] == 1536 * MiB and result["unseen_bytes_at_oom"] is None


def test_outside_pytorch_refuses_other_runs(real_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(AnalyzerError, match="no device memory events"):
        outside_pytorch(load(RUN_PICKLE), load(real_dir / "nvidia-fuser/report1.sqlite"))
    with open(RUN_PICKLE, "rb") as f:
        data = load_untrusted(f, str(RUN_PICKLE))
    for segment in data["segments"]:
        segment["address"] += 1 << 40
        for block in segment["blocks"]:
            block["address"] += 1 << 40
    for entry in data["device_traces"][0]:
        entry["addr"] = entry.get("addr", 0) + (1 << 40)
    other = tmp_path / "other.pickle"
    other.write_bytes(pickle.dumps(data, protocol=4))
    with pytest.raises(AnalyzerError, match="not recordings of the same process"):
        outside_pytorch(snapshot_to_trace(data, str(other)), load(RUN_SQLITE))


# ---- small pieces ----------------------------------------------------------------------------------
def test_annotation_names() -> None:
    assert annotation_name("aten::addmm, seq = 12, sizes = [[64, 1024]]") == "aten::addmm"
    assert annotation_name("aten::mm, op_id = 40") == "aten::mm"
    assert annotation_name("MmBackward0, stashed seq = 3") == "MmBackward0"
    assert annotation_name("{'mod': 'Tensor', 'op': 'cuda', 'args': []}") == "Tensor.cuda"
    assert annotation_name('{"model_config": {"emit_nvtx": true}}') == '{"model_config": {"emit_nvtx": true}}'
    assert annotation_name("{not a dict") == "{not a dict"
    assert annotation_name("forward") == "forward"


def test_global_tid_decoding(real_dir: Path) -> None:
    path = real_dir / "dlprof/nsys_profile.sqlite"
    (global_tid,), = query(path, "SELECT DISTINCT globalTid FROM NVTX_EVENTS")
    (pid,), = query(path, "SELECT pid FROM PROCESSES WHERE name = 'python3'")
    assert decode_global_tid(global_tid)[0] == pid == 9908
