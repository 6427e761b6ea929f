"""Finding a job's per-rank files (issue 22): torchtitan's and analyzer.capture's layouts, one file per rank
(an OOM dump first, then an exit dump, then the latest), traces whose rank is inside, links and other files
skipped with a reason, a bounded walk."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from analyzer.errors import UnsupportedFormat
from analyzer.ingest import ranks
from analyzer.ingest.ranks import find_rank_files, rank_of
from support.paths import ROOT

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "traces"
SNAPSHOT = FIXTURES / "sim" / "activation_cache.pickle"
TRACE = next(FIXTURES.rglob("*.json.gz"), None)


def put(root: Path, relative: str, source: Path = SNAPSHOT) -> Path:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, path)
    return path


def test_torchtitan_layout_takes_the_exit_dump_of_each_rank(tmp_path):
    for rank in range(3):
        put(tmp_path, f"memory_snapshot/iteration_10/rank{rank}_memory_snapshot.pickle")
        put(tmp_path, f"memory_snapshot/iteration_20/rank{rank}_memory_snapshot.pickle")
    put(tmp_path, "memory_snapshot/iteration_15_exit/rank1_memory_snapshot.pickle")
    found = find_rank_files(tmp_path)
    chosen = {f.rank: str(f.path.relative_to(tmp_path)) for f in found.files}
    assert chosen == {0: "memory_snapshot/iteration_20/rank0_memory_snapshot.pickle",
                      1: "memory_snapshot/iteration_15_exit/rank1_memory_snapshot.pickle",
                      2: "memory_snapshot/iteration_20/rank2_memory_snapshot.pickle"}
    assert [f.rank for f in found.files] == [0, 1, 2]
    assert any(w.startswith("rank 1: analysed memory_snapshot/iteration_15_exit") and "2 other" in w
               for w in found.warnings)


def test_capture_layout_takes_the_oom_dump(tmp_path):
    for name in ("rank0_step2.pickle", "rank0_step4_exit.pickle", "rank0_step3_oom1.pickle", "rank1_step4.pickle"):
        put(tmp_path, name)
    chosen = {f.rank: f.path.name for f in find_rank_files(tmp_path).files}
    assert chosen == {0: "rank0_step3_oom1.pickle", 1: "rank1_step4.pickle"}


def test_rank_from_a_folder_name_and_not_from_digits_elsewhere(tmp_path):
    assert rank_of(tmp_path / "rank_7" / "snap.pickle", tmp_path) == 7
    assert rank_of(tmp_path / "rank-12.pickle", tmp_path) == 12
    assert rank_of(tmp_path / "frank3.pickle", tmp_path) is None
    assert rank_of(tmp_path / "memory.pickle", tmp_path) is None


@pytest.mark.skipif(TRACE is None, reason="no profiler trace fixture")
def test_files_without_a_rank_in_their_name_are_all_kept(tmp_path):
    put(tmp_path, "a.pt.trace.json.gz", TRACE)
    put(tmp_path, "b.pt.trace.json.gz", TRACE)
    found = find_rank_files(tmp_path)
    assert [f.rank for f in found.files] == [None, None] and [f.kind for f in found.files] == ["kineto"] * 2


def test_links_other_files_and_empty_folders(tmp_path):
    put(tmp_path, "rank0.pickle")
    (tmp_path / "notes.txt").write_text("hello")
    os.symlink("/etc/passwd", tmp_path / "rank1.pickle")
    found = find_rank_files(tmp_path)
    assert [f.rank for f in found.files] == [0]
    assert any("rank1.pickle: a symbolic link (not followed)" in w for w in found.warnings)
    assert any(w.startswith("skipped notes.txt") for w in found.warnings)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UnsupportedFormat, match="holds no memory snapshot or profiler trace"):
        find_rank_files(empty)


def test_the_walk_is_bounded_in_depth_and_entries(tmp_path, monkeypatch):
    monkeypatch.setattr(ranks, "MAX_DEPTH", 2)
    put(tmp_path, "a/b/rank0.pickle")
    put(tmp_path, "a/b/c/d/rank1.pickle")
    found = find_rank_files(tmp_path)
    assert [f.rank for f in found.files] == [0]
    assert any("deeper than 2 levels" in w for w in found.warnings)
    monkeypatch.setattr(ranks, "MAX_FILES", 2)
    put(tmp_path, "rank5.pickle")
    found = find_rank_files(tmp_path)   # the root's two entries, then the limit: nothing below `a` is seen
    assert [f.rank for f in found.files] == [5]
    assert any(w.startswith("stopped after 2 entries") for w in found.warnings)


def test_files_of_one_rank_from_different_runs_are_all_kept(tmp_path):
    """Issue 33.3: `rank0.json.gz` and `sampled_rank-0.json.gz` name rank 0 but are not dumps of one run (their
    names differ in more than iteration, OOM and exit marks): both are kept, for the job to find they clash."""
    put(tmp_path, "rank0_snapshot.pickle")
    put(tmp_path, "sampled_rank0_snapshot.pickle")
    put(tmp_path, "rank1_step3_snapshot.pickle")
    put(tmp_path, "rank1_step4_snapshot.pickle")
    found = find_rank_files(tmp_path)
    assert [f.path.name for f in found.files] == ["rank0_snapshot.pickle", "sampled_rank0_snapshot.pickle",
                                                  "rank1_step4_snapshot.pickle"]


def test_files_are_one_job_only_when_they_say_so():
    """Issue 33.3, each rule on each side: ranks named, none twice, one world size that holds them."""
    from analyzer.result import Claim, not_one_job

    def claims(*spec):
        return [Claim(f"f{i}", rank, world) for i, (rank, world) in enumerate(spec)]

    assert not_one_job(claims((0, 4), (1, 4), (3, 4))) is None
    assert not_one_job(claims((0, None), (1, None))) is None          # torchtitan: ranks in names, no world size
    assert not_one_job(claims((0, None))) is None                     # one file is one file
    assert not_one_job(claims((0, 2), (1, 16))) == "their world sizes differ: 2, 16"
    assert not_one_job(claims((0, 4), (0, 4))) == "rank 0 is in 2 files"
    assert not_one_job(claims((0, 4), (None, None))) == "f1 names no rank"
    assert not_one_job(claims((None, None), (None, None))) == "f0 and 1 more name no rank"
    assert not_one_job(claims((0, 2), (2, 2))) == "rank 2 is outside a world of 2"
    assert not_one_job(claims((0, 2), (1, 2))) is None


def test_identical_warnings_are_said_once_with_who_said_them():
    from analyzer.job import folded

    said = [(f"rank {r}", "no memory events") for r in range(8)] + [("rank 3", "truncated")]
    assert folded(said, 8, "ranks") == ["all 8 ranks: no memory events", "rank 3: truncated"]
    assert folded(said[:5], 8, "ranks") == ["rank 0, rank 1, rank 2 and 2 more: no memory events"]
    assert folded(said[:2], 8, "ranks") == ["rank 0, rank 1: no memory events"]


def test_a_folder_of_text_logs_is_told_how_to_read_them(tmp_path):
    """torchrun --log-dir writes one text log a rank: the folder holds no recording, and the error says how its
    logs can be read (one alone, or several as one text on standard input); an empty folder is not told so."""
    logs = tmp_path / "logs"
    logs.mkdir()
    for rank in (0, 1):
        (logs / f"rank{rank}.log").write_bytes((ROOT / "fixtures/logs/ofwhich_fragmentation_lerf_73.log").read_bytes())
    with pytest.raises(UnsupportedFormat) as told:
        find_rank_files(logs)
    assert "but 2 text logs" in told.value.problem and "analyze -" in told.value.hint
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UnsupportedFormat) as bare:
        find_rank_files(empty)
    assert "text log" not in bare.value.problem
