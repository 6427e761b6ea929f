"""A job's ranks analysed on Dask (issue 22): one result per rank with only summaries coming back, a bad rank
reported while the others are analysed, the worst rank first and why, a cluster the user already runs; and the
imbalance across the GPUs of one real snapshot."""
from __future__ import annotations

import contextlib
import shutil
import socket
from pathlib import Path

import pytest

from analyzer.commands.job_view import RankShown, rank_shown
from analyzer.job import SCHEDULER_VARIABLE, JobAnalysis, analyze_job
from tests.support.paths import REAL, SIM


@pytest.fixture(scope="module")
def job_dir(tmp_path_factory) -> Path:
    """Three ranks as torchtitan writes them (rank 1 ran out of memory), and a rank whose file is cut short."""
    root = tmp_path_factory.mktemp("job") / "memory_snapshot"
    for rank, name in ((0, "activation_cache"), (1, "capacity_oom"), (2, "adam_first_step")):
        target = root / "iteration_4_exit" / f"rank{rank}_memory_snapshot.pickle"
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(SIM / f"{name}.pickle", target)
    data = (SIM / "activation_cache.pickle").read_bytes()
    (root / "iteration_4_exit" / "rank3_memory_snapshot.pickle").write_bytes(data[: len(data) // 3])
    return root


@pytest.fixture(scope="module")
def job(job_dir) -> JobAnalysis[RankShown]:
    seen: list[str] = []
    result = analyze_job(job_dir, rank_shown, workers=2, on_done=lambda r, total: seen.append(f"{r.label}/{total}"))
    assert sorted(seen) == ["rank 0/4", "rank 1/4", "rank 2/4", "rank 3/4"]   # the progress callback counts every rank
    return result


def test_every_rank_comes_back_as_a_summary_never_a_trace(job):
    assert [r.rank for r in job.ranks] == [0, 1, 2, 3]
    good = [r for r in job.ranks if r.error is None]
    assert len(good) == 3 and all(r.shown is not None and r.document is not None for r in good)
    assert not any(hasattr(r, "trace") for r in job.ranks)


def test_a_bad_rank_is_reported_and_the_others_analysed(job):
    bad = job.ranks[3]
    assert bad.error is not None and bad.shown is None and "rank3_memory_snapshot.pickle" in bad.error
    doc = job.to_json()
    assert doc["job"]["failed_ranks"] == [{"label": "rank 3", "path": bad.path, "error": bad.error}]
    assert {d["rank"] for d in doc["devices"]} == {0, 1, 2}


def test_the_worst_rank_comes_first_with_why(job):
    from analyzer.commands.job_view import job_report

    # the report leads with the worst rank's device; the bad rank has none and appears among the warnings
    assert [d.name for d in job_report(job).view.devices] == ["rank 1 cuda:0", "rank 2 cuda:0", "rank 0 cuda:0"]
    details = job.imbalance.evidence.details
    assert details.worst == "rank 1 cuda:0" and details.median == "rank 2 cuda:0"
    peaks = {p.label: p.peak_bytes for r in job.ranks for p in r.peaks}
    assert details.ratio == round(peaks["rank 1 cuda:0"] / peaks["rank 2 cuda:0"], 3)
    assert details.category == "activation"


def test_a_cluster_the_user_runs_is_used(job_dir, job, monkeypatch):
    from dask.distributed import LocalCluster

    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False, protocol="tcp://",
                      dashboard_address=None) as cluster:   # a tcp:// address, as a cluster of the user's has
        monkeypatch.setenv(SCHEDULER_VARIABLE, cluster.scheduler_address)
        again = analyze_job(job_dir, rank_shown)
    assert [p for r in again.ranks for p in r.peaks] == [p for r in job.ranks for p in r.peaks]


def test_the_gpus_of_one_snapshot_are_compared():
    if not REAL.is_dir():
        pytest.skip(f"real recordings not found at {REAL}")
    from analyzer.pipeline import analyze

    analysis = analyze(REAL / "constructor-sun-code_location" / "memory_snapshot.pickle")
    details = analysis.imbalance.evidence.details
    # TRUTH.md: cuda:1 78.29 GiB at the OOM, cuda:2 20 GiB, cuda:0 7.9 GiB (torch_geometric DataParallel)
    assert (details.worst, details.median, details.category) == ("cuda:1", "cuda:2", "activation")
    assert round(details.worst_peak_bytes / 2**30, 2) == 78.29
    assert [p["label"] for p in details.peaks] == ["cuda:1", "cuda:2", "cuda:0"]


def test_analyze_a_folder_writes_one_report_for_the_job(job_dir, tmp_path, capsys):
    from analyzer.commands import main

    out = tmp_path / "ranks.html"
    assert main([str(job_dir), "-o", str(out), "--workers", "1"]) == 0
    page = out.read_text()
    printed = capsys.readouterr().out
    assert "Imbalance" in page and page.index("rank 1 cuda:0") < page.index("rank 2 cuda:0")
    assert "imbalance: rank 1 cuda:0 peaks at" in " ".join(printed.split())
    assert "rank 3: not analysed" in " ".join(printed.split())
    taken = socket.socket()            # Dask's default HTTP port taken by something else: nothing on stderr
    with contextlib.suppress(OSError):
        taken.bind(("", 8787))
        taken.listen()
    with taken:
        assert main([str(job_dir), "-o", str(tmp_path / "ranks.json"), "--workers", "1", "-q"]) == 0
    assert capsys.readouterr().err == ""
    import json

    doc = json.loads((tmp_path / "ranks.json").read_text())
    assert doc["job"]["imbalance"]["evidence"]["details"]["worst"] == "rank 1 cuda:0"
    assert [d["rank"] for d in doc["devices"]] == [0, 1, 2]


def test_the_api_reads_a_folder_of_snapshots_and_skips_a_bad_rank(job_dir):
    import analyzer

    loaded = analyzer.load(job_dir)
    assert loaded.ranks == [0, 1, 2]
    assert any(w.startswith("rank 3: not read") for w in loaded.warnings)
    document = analyzer.analyze(loaded).to_json()   # the set's own warnings reach its JSON, as a job's do
    assert [w for w in document["warnings"] if w.startswith("rank 3: not read")] == \
        [w for w in loaded.warnings if w.startswith("rank 3: not read")]
    assert [d["rank"] for d in document["devices"]] == [0, 1, 2]


def test_a_job_whose_ranks_hold_no_memory_says_so_not_that_they_failed():
    if not REAL.is_dir():
        pytest.skip(f"real recordings not found at {REAL}")
    from analyzer.commands.job_view import job_report
    from analyzer.job import job_of
    from analyzer.pipeline import analyze

    ranks = analyze(REAL / "param" / "dlrm_kineto.tar.gz")
    assert ranks.separate is None   # ranks 0-7 of a world of 8: one job, in the Python API too
    report = job_report(job_of(ranks, rank_shown))   # 8 ranks, no [memory] events
    assert report.view.verdict.startswith("None of the 8 ranks analysed recorded any memory")
    assert not report.view.devices and report.document["job"]["failed_ranks"] == []
    warned = report.view.warnings
    assert len(warned) == 2 and all(w.startswith("all 8 ranks: ") for w in warned)  # issue 33.3: folded, not 16


def test_a_folder_of_unrelated_traces_is_not_one_job(tmp_path):
    """Issue 33.3: HTA's test folder holds traces of jobs of 2, 16, 128 and 300 ranks and a memory timeline: each
    is analysed on its own, none is compared with the others, and the table lists them all."""
    if not REAL.is_dir():
        pytest.skip(f"real recordings not found at {REAL}")
    from analyzer.commands.job_view import job_report

    job = analyze_job(REAL / "hta", rank_shown, workers=2)
    assert job.separate == "their world sizes differ: 2, 16, 128, 300" and job.imbalance is None
    report = job_report(job)
    assert report.view.input.kind == "6 separate recordings" and report.view.comparison is None
    assert report.view.verdict.startswith("6 separate recordings, not the ranks of one job")
    assert "imbalance" not in report.view.verdict and "ranks" not in report.view.input.kind
    assert sorted(r.label for r in report.view.recordings) == sorted(
        ["rank0.json.gz", "sampled_rank-0.json.gz", "sampled_rank-1.json.gz", "df_index_resolver.json.gz",
         "rank-34.Jul_15_10_52_41.1074.pt.trace.json.gz", "memory_timeline.raw.gz"])
    assert report.document["job"]["separate"] == job.separate
    from analyzer.report.markdown import render_markdown

    md = render_markdown(report.view, None)
    assert "| `rank0.json.gz` | no GPU memory |" in md and "| `df_index_resolver.json.gz` | 6.17 GiB cuda\\:1 |" in md


def test_two_windows_of_one_worker_are_not_two_ranks():
    """Issue 33.3: two profiling windows of one worker (no rank anywhere) are two recordings, not 2 ranks."""
    if not REAL.is_dir():
        pytest.skip(f"real recordings not found at {REAL}")
    job = analyze_job(REAL / "kineto-tb_plugin" / "resnet50_num_workers_0", rank_shown, workers=2)
    assert job.separate == "worker0.1623143089861.pt.trace.json.gz and 1 more name no rank"
    assert job.imbalance is None
    from analyzer.pipeline import analyze

    assert analyze(REAL / "kineto-tb_plugin" / "resnet50_num_workers_0").separate == job.separate   # the API too
