"""Issue 20: every class of its hostile corpus, generated here at sizes N and 2N, ends in exit 0 or one exit-2 line
naming the file, the problem and (for a limit) its environment variable. Scaling is measured by operation counts
and sizes, never by wall time."""
from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

import analyzer.ingest.snapshot_history as history
from analyzer.attribute.ranges import innermost
from analyzer.core.module_tree import module_tree
from analyzer.core.printable import MAX_SHOWN, printable, visible
from analyzer.errors import CorruptInput, UnsupportedFormat
from analyzer.ingest import load
from analyzer.ingest.snapshot import snapshot_to_trace
from tests.hostile import round2

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "traces" / "nsys" / "oom_with_nccl.pickle"


def _cli(*args: str | Path, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "analyzer", *map(str, args)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **(env or {})}, cwd=cwd)


def _one_error_line(run: subprocess.CompletedProcess, *words: str) -> str:
    lines = run.stderr.splitlines()
    assert run.returncode == 2 and len(lines) == 1, run.stderr
    assert all(w in lines[0] for w in words), lines[0]
    return lines[0]


# ---- amplification ------------------------------------------------------------------------------------------
def test_memo_references_are_refused_not_expanded(tmp_path: Path) -> None:
    path = tmp_path / "memo.pickle.gz"
    path.write_bytes(round2.memo_amplified(4_000_000))
    assert path.stat().st_size < 100_000
    _one_error_line(_cli(path, "-q"), str(path), "repeats the same entry object")


def test_the_memory_limit_stops_a_read_and_names_its_variable(tmp_path: Path) -> None:
    path = tmp_path / "memo.pickle.gz"
    path.write_bytes(round2.memo_amplified(4_000_000))  # a list of 4M references: 32 MB once unpickled
    _one_error_line(_cli(path, "-q", env={"ANALYZER_MAX_READ_MEMORY": "16MiB"}), str(path), "ANALYZER_MAX_READ_MEMORY")


def test_tuple_keys_that_hang_the_unpickler_end_at_the_cpu_limit(tmp_path: Path) -> None:
    path = tmp_path / "keys.pickle"
    path.write_bytes(round2.tuple_keys(60))
    _one_error_line(_cli(path, "-q", env={"ANALYZER_MAX_READ_SECONDS": "1"}), str(path), "CPU time",
                    "ANALYZER_MAX_READ_SECONDS")
    shallow = tmp_path / "shallow.pickle"  # the other side: a key the unpickler hashes at once
    shallow.write_bytes(round2.tuple_keys(3))
    assert isinstance(load(shallow).allocations, pd.DataFrame)


def test_a_confined_read_gives_the_same_trace() -> None:
    confined, direct = load(FIXTURE), snapshot_to_trace(pickle.loads(FIXTURE.read_bytes()), str(FIXTURE))
    pd.testing.assert_frame_equal(confined.allocations, direct.allocations)


# ---- SQLite generated columns -------------------------------------------------------------------------------
def test_a_generated_string_column_is_never_evaluated(tmp_path: Path) -> None:
    path = tmp_path / "strings.sqlite"  # zeroblob(2e9) raises "string or blob too big" if any query evaluates it
    path.write_bytes(round2.nsys_with_generated("StringIds", "value", "zeroblob(2000000000)"))
    with pytest.raises(UnsupportedFormat, match="never generated ones"):
        load(path)


def test_a_generated_column_elsewhere_reads_as_absent(tmp_path: Path) -> None:
    path = tmp_path / "nvtx.sqlite"
    path.write_bytes(round2.nsys_with_generated("NVTX_EVENTS", "text", "zeroblob(2000000000)"))
    trace = load(path)
    assert int(trace.segments["bytes"].sum()) == 1 << 20


# ---- quadratic shapes, by operation counts at N and 2N ---------------------------------------------------
class _Counting:
    """An array whose reads are counted."""

    def __init__(self, values: np.ndarray) -> None:
        self.values, self.reads = values, 0

    def __getitem__(self, i: int) -> float:
        self.reads += 1
        return float(self.values[i])


def _open_ranges_reads(n: int) -> int:
    ranges = pd.DataFrame({"start_us": np.arange(n, dtype=float), "end_us": [pd.NA] * n})
    priority = _Counting(np.arange(n, dtype=float) % 7)
    found = innermost(ranges, np.arange(n, dtype=float) + 0.5, priority)  # type: ignore[arg-type]
    assert found[-1] == max(range(n), key=lambda r: (r % 7, r))
    return priority.reads


def test_open_ranges_without_end_are_linear() -> None:
    small, large = _open_ranges_reads(2000), _open_ranges_reads(4000)
    assert small == 2000 and large == 4000  # one read a range; the old sweep read every open range per event


def _comparisons(n: int, monkeypatch: pytest.MonkeyPatch) -> int:
    calls = [0]
    real = history.is_

    def counting(a: object, b: object) -> bool:
        calls[0] += 1
        return real(a, b)

    monkeypatch.setattr(history, "is_", counting)
    trace = snapshot_to_trace(round2.shared_probe_stacks(n), "probe")
    assert len(trace.stacks) == n + 1  # and the segments' own stack
    return calls[0]


def test_stacks_sharing_their_probe_frames_are_interned_linearly(monkeypatch: pytest.MonkeyPatch) -> None:
    small, large = _comparisons(500, monkeypatch), _comparisons(1000, monkeypatch)
    assert large <= 2.2 * small, (small, large)  # was quadratic: every new stack compared with all before


@pytest.mark.parametrize("parts", [2_500, 3_000])
def test_a_module_name_of_thousands_of_parts_nests_without_recursing(parts: int) -> None:
    live = pd.DataFrame({"module": [".".join(f"m{i}" for i in range(parts)), "head"],
                         "allocated_bytes": [3 << 20, 1 << 20]})
    roots = module_tree(live)
    assert sum(r.bytes for r in roots) == 4 << 20
    node, depth = roots[0], 1
    while node.children:
        node, depth = node.children[0], depth + 1
    assert node.bytes == 3 << 20 and depth == 1  # a chain with nothing of its own reads as one name


@pytest.mark.parametrize("fmt", ["html", "md", "json"])
def test_huge_strings_are_shortened_in_every_report(tmp_path: Path, fmt: str) -> None:
    sizes = {}
    for chars in (1 << 20, 2 << 20):
        path = tmp_path / f"huge{chars}.pickle"
        path.write_bytes(pickle.dumps(round2.huge_names(chars)))
        out = tmp_path / f"huge{chars}.{fmt}"
        run = _cli(path, "-q", "--format", fmt, "-o", out)
        assert run.returncode == 0, run.stderr
        sizes[chars] = out.stat().st_size
        assert "shortened" in out.read_text(encoding="utf-8")
    assert sizes[2 << 20] <= sizes[1 << 20] * 1.01 and sizes[1 << 20] < 40 * 40 * MAX_SHOWN, sizes


# ---- the report's path --------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt,link", [("html", "trace.analysis.html"), ("md", "trace.analysis.png")])
def test_a_planted_link_at_the_default_path_is_refused(tmp_path: Path, fmt: str, link: str) -> None:
    victim = tmp_path / "bashrc"
    victim.write_text("keep\n")
    (tmp_path / "trace.pickle").write_bytes(FIXTURE.read_bytes())
    (tmp_path / link).symlink_to(victim)
    _one_error_line(_cli(tmp_path / "trace.pickle", "-q", "--format", fmt), link, "symbolic link")
    assert victim.read_text() == "keep\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["bashrc", "trace.pickle", link])


def test_an_explicit_path_replaces_a_link_instead_of_writing_through_it(tmp_path: Path) -> None:
    victim = tmp_path / "bashrc"
    victim.write_text("keep\n")
    (tmp_path / "r.html").symlink_to(victim)
    assert _cli(FIXTURE, "-q", "-o", tmp_path / "r.html").returncode == 0
    assert victim.read_text() == "keep\n" and not (tmp_path / "r.html").is_symlink()


@pytest.mark.parametrize("where,words", [("/nonexistent/dir/r.html", "does not exist"), (None, "is a directory"),
                                         ("/dev/full", "No space left")])
def test_an_unwritable_output_is_one_line(tmp_path: Path, where: str | None, words: str) -> None:
    _one_error_line(_cli(FIXTURE, "-q", "-o", where or tmp_path), words)


def test_the_format_follows_the_suffix(tmp_path: Path) -> None:
    assert _cli(FIXTURE, "-q", "-o", tmp_path / "x.pdf").returncode == 0
    assert (tmp_path / "x.pdf").read_bytes()[:5] == b"%PDF-"
    assert _cli(FIXTURE, "-q", "-o", tmp_path / "x.unknown").returncode == 0
    assert (tmp_path / "x.unknown").read_bytes().lstrip()[:15].lower() == b"<!doctype html>"


def test_paths_with_markup_are_printed_as_written(tmp_path: Path) -> None:
    folder = tmp_path / "r[/bold]x[link=evil.example]y[/link]z"
    folder.mkdir(parents=True)
    run = _cli(FIXTURE, "-o", folder / "rep.html", env={"COLUMNS": "1000"})
    assert run.returncode == 0, run.stderr
    assert f"report written to {folder / 'rep.html'}\n" in run.stdout


def test_the_users_model_raising_is_one_line(tmp_path: Path) -> None:
    script = tmp_path / "model.py"
    script.write_text("def model_fn():\n    raise ValueError('bad layer size')\n"
                      "def batch_fn(model):\n    return None\ndef optimizer_fn(model):\n    return None\n")
    run = _cli("simulate", script, "--gpu-memory", "1GiB", "-o", tmp_path / "s.pickle")
    _one_error_line(run, str(script), "ValueError: bad layer size")


# ---- terminal controls ------------------------------------------------------------------------------------
def test_printable_and_visible_escape_every_control() -> None:
    for control in round2.CONTROLS:
        assert not set(printable(f"a{control}b")) & (round2.RAW | {"\n"})
        assert not set(visible(f"a{control}b")) & round2.RAW
    assert printable("plain ü → text") == "plain ü → text"


def test_controls_reach_no_printed_line(tmp_path: Path) -> None:
    """Every control at once, in every string of the input that reaches the terminal, and in a corrupt file's own
    name (one run each: printable() is held to every control alone above)."""
    every = "".join(f"x{control}y" for control in round2.CONTROLS)
    path = tmp_path / "controls.pickle"
    path.write_bytes(pickle.dumps(round2.with_controls(every)))
    run = _cli(path, "-o", tmp_path / "r.md")
    assert run.returncode == 0, run.stderr
    assert not set(run.stdout + run.stderr) & round2.RAW, repr(run.stdout)
    assert not any(line.startswith("report written to ok.html") for line in run.stdout.splitlines())
    named = tmp_path / f"bad{every.replace('/', '').replace(chr(0), '')}.pickle"  # a corrupt file whose own name carries them
    named.write_bytes(b"\x80\x04K")
    line = _one_error_line(_cli(named, "-q"), "not a readable pickle")
    assert not set(line) & round2.RAW


# ---- numbers ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("field,value", [("device_free", -10**15), ("time_us", 2**62), ("time_us", -(2**62))])
def test_numbers_out_of_range_are_refused(field: str, value: int) -> None:
    data = round2.small_snapshot()
    entry = data["device_traces"][0][-1]
    if field == "device_free":
        data["device_traces"][0].append({**entry, "action": "oom", "device_free": value})
    else:
        entry[field] = value
    with pytest.raises(CorruptInput, match="outside|beyond"):
        snapshot_to_trace(data, "numbers")
    data["device_traces"][0][-1][field] = 1000  # the other side: a plain value is read
    assert isinstance(snapshot_to_trace(data, "numbers").allocations, pd.DataFrame)



def test_step_and_line_numbers_too_long_for_int64_are_read_as_names(tmp_path: Path) -> None:
    """`ProfilerStep#` and a frame's line followed by 30 nines: no step, no frame line, exit 0 (once OverflowError)."""
    nines = "9" * 30
    events = [{"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{nines}", "pid": 1, "tid": 1, "ts": 1.0,
               "dur": 100.0},
              {"ph": "X", "cat": "python_function", "name": f"train.py({nines}): main", "pid": 1, "tid": 1, "ts": 2.0,
               "dur": 90.0, "args": {"Python id": 1, "Python parent id": None}},
              {"ph": "i", "cat": "cpu_instant_event", "s": "t", "name": "[memory]", "pid": 1, "tid": 1, "ts": 3.0,
               "args": {"Total Reserved": 1 << 21, "Total Allocated": 1 << 20, "Bytes": 1 << 20, "Device Id": 0,
                        "Device Type": 1, "Addr": 4096}}]
    path = tmp_path / "nines.json"
    path.write_text(json.dumps({"schemaVersion": 1, "traceEvents": events}))
    run = _cli(path, "--format", "json", "-o", tmp_path / "out.json")
    assert run.returncode == 0, run.stderr
    doc = json.loads((tmp_path / "out.json").read_text())
    assert doc["devices"][0]["peak"]["allocated_bytes"] == 1 << 20


def test_an_archive_member_that_expands_past_the_ratio_is_refused(tmp_path: Path) -> None:
    """A small .tar.gz of one huge trace of whitespace: the ratio check of a plain .json.gz holds for members."""
    import io
    import tarfile

    body = b'{"traceEvents": [' + b" " * (80 << 20) + b"]}"
    path = tmp_path / "ranks.tar.gz"
    with tarfile.open(path, "w:gz") as archive:
        info = tarfile.TarInfo("rank0.json")
        info.size = len(body)
        archive.addfile(info, io.BytesIO(body))
    assert path.stat().st_size < 1 << 20
    _one_error_line(_cli(path, "-o", tmp_path / "r.html"), "ranks.tar.gz", "times its own size",
                    "ANALYZER_MAX_COMPRESSION_RATIO")


def test_a_reader_stuck_without_cpu_is_ended_by_the_wall_clock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """RLIMIT_CPU never fires for a child that waits (a lock held at the fork): the parent's deadline kills it."""
    import importlib
    import time

    from analyzer.errors import ResourceLimit

    confined = importlib.import_module("analyzer.ingest.confined")   # the package re-exports the function's name
    monkeypatch.setenv("ANALYZER_MAX_READ_SECONDS", "1")
    monkeypatch.setattr(confined, "WALL_SECONDS_PER_CPU_SECOND", 1)
    monkeypatch.setattr(confined, "WALL_SECONDS_SLACK", 0)
    path = tmp_path / "any.pickle"
    path.write_bytes(b"\x80\x04N.")
    with pytest.raises(ResourceLimit, match="did not finish within 1 s of wall-clock time"):
        confined.confined(lambda: time.sleep(60), path)
    assert confined.confined(lambda: 7, path) == 7   # a read that ends is untouched
