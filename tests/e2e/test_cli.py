"""The CLI on good and bad input: one clear line and exit code 2 for bad input, never a traceback."""
from __future__ import annotations

import gzip
import json
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import pytest

from support.paths import REAL


def run_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "analyzer", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=120)


def tiny_snapshot() -> dict:
    """A two-allocation snapshot in the torch 2.13 layout, written by hand."""
    frames = [{"filename": "/home/u/train.py", "line": 12, "name": "forward"}]
    base = 0x7F0000000000
    block = {"address": base, "size": 2 << 20, "requested_size": 1000, "state": "inactive", "frames": []}
    return {
        "segments": [{"device": 0, "address": base, "total_size": 2 << 20, "allocated_size": 0, "active_size": 0,
                      "requested_size": 0, "stream": 0, "segment_type": "small", "segment_pool_id": (0, 0),
                      "is_expandable": False, "frames": [], "blocks": [block]}],
        "device_traces": [[
            {"action": "segment_alloc", "addr": base, "size": 2 << 20, "stream": 0, "time_us": 1, "frames": frames},
            {"action": "alloc", "addr": base, "size": 1000, "stream": 0, "time_us": 2, "frames": frames},
            {"action": "alloc", "addr": base + 1024, "size": 3000, "stream": 0, "time_us": 3, "frames": frames},
            {"action": "free_requested", "addr": base, "size": 1000, "stream": 0, "time_us": 4, "frames": frames},
            {"action": "free_completed", "addr": base, "size": 1000, "stream": 0, "time_us": 4, "frames": frames},
            {"action": "free_requested", "addr": base + 1024, "size": 3000, "stream": 0, "time_us": 5, "frames": frames},
            {"action": "free_completed", "addr": base + 1024, "size": 3000, "stream": 0, "time_us": 5, "frames": frames},
        ]],
        "allocator_settings": {"expandable_segments": False},
        "external_annotations": [],
    }


def test_tiny_snapshot_numbers(tmp_path: Path) -> None:
    path = tmp_path / "tiny.pickle"
    path.write_bytes(pickle.dumps(tiny_snapshot(), protocol=4))
    run = run_cli(str(path), "--format", "json", "-q")
    assert run.returncode == 0, run.stderr
    d = json.loads(run.stdout)["devices"][0]
    assert d["peak"]["allocated_bytes"] == 1024 + 3072  # 512-byte rounding of 1000 and 3000
    assert d["peak"]["requested_bytes"] == 4000
    assert d["peak"]["event_index"] == 2
    assert d["reserved_peak_bytes"] == 2 << 20
    assert d["end"] == {"allocated_bytes": 0, "requested_bytes": 0, "reserved_bytes": 2 << 20,
                        "inactive_bytes": 2 << 20, "largest_free_block_bytes": 2 << 20}
    assert d["peak"]["top_allocations"][0]["top_user_frame"] == "/home/u/train.py:12 forward"


def test_gzip_snapshot_and_html_beside_input(tmp_path: Path) -> None:
    path = tmp_path / "tiny.pickle.gz"
    path.write_bytes(gzip.compress(pickle.dumps(tiny_snapshot(), protocol=4)))
    run = run_cli(str(path))
    assert run.returncode == 0, run.stderr
    html = (tmp_path / "tiny.analysis.html").read_text()
    assert "<svg" in html
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html), "the report must load nothing"
    assert "train.py:12 forward" in html


def test_malicious_pickle_creates_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    path = tmp_path / "evil.pickle"
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": [], "x": Payload()}, protocol=4))
    run = run_cli(str(path), "-o", str(tmp_path / "out.html"))
    assert run.returncode == 2
    assert not marker.exists()
    assert "refused" in run.stderr and str(path) in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1 and "Traceback" not in run.stderr
    assert not (tmp_path / "out.html").exists()


def _bad_inputs(tmp_path: Path) -> dict[str, Path]:
    good = pickle.dumps(tiny_snapshot(), protocol=4)
    cases = {
        "empty": b"",
        "truncated": good[: len(good) // 2],
        "text": b"hello, this is not a snapshot\n",
        "other_pickle": pickle.dumps([1, 2, 3], protocol=4),
        "dict_without_segments": pickle.dumps({"a": 1}, protocol=4),
        "bad_gzip": b"\x1f\x8b\x08\x00garbage-garbage",
        "wrong_types": pickle.dumps({"segments": [{"device": "zero"}], "device_traces": []}, protocol=4),
    }
    paths = {}
    for name, content in cases.items():
        p = tmp_path / f"{name}.pickle"
        p.write_bytes(content)
        paths[name] = p
    paths["missing"] = tmp_path / "missing.pickle"
    paths["directory"] = tmp_path / "a_dir"
    paths["directory"].mkdir()
    return paths


@pytest.mark.parametrize("case", ["empty", "truncated", "text", "other_pickle", "dict_without_segments", "bad_gzip",
                                  "wrong_types", "missing", "directory"])
def test_bad_input_is_one_clear_line(tmp_path: Path, case: str) -> None:
    path = _bad_inputs(tmp_path)[case]
    out = tmp_path / "report.html"
    run = run_cli(str(path), "-o", str(out))
    assert run.returncode == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in run.stderr
    assert str(path) in lines[0]
    assert not out.exists()


def test_nsys_rep_says_how_to_export(tmp_path: Path) -> None:
    rep = REAL / "dlprof" / "nsys_profile.nsys-rep"
    if not rep.exists():
        pytest.skip(f"{rep} absent")
    run = run_cli(str(rep))
    assert run.returncode == 2
    assert "nsys export --type sqlite" in run.stderr


def test_help_lists_options() -> None:
    run = run_cli("--help")
    assert run.returncode == 0 and "--format" in run.stdout


def test_reserved_is_stated_only_where_the_input_records_it(tmp_path: Path) -> None:
    """A memory timeline records no reserved bytes: the summary says so instead of the allocator model's estimate;
    a snapshot records them, and the summary states them."""
    timeline = Path(__file__).resolve().parents[2] / "fixtures/traces/kineto/train.memory_timeline.raw.json.gz"
    said = run_cli(str(timeline), "-o", str(tmp_path / "timeline.md"))
    assert said.returncode == 0, said.stderr
    text = " ".join(said.stdout.split())   # the terminal wraps lines
    assert "reserved not recorded" in text and "highest reserved" not in text
    assert "ring buffer" not in text and "lists them as existing before the profiled steps" in text
    assert "reserved not recorded" in (tmp_path / "timeline.md").read_text(encoding="utf-8")
    snapshot = tmp_path / "tiny.pickle"
    snapshot.write_bytes(pickle.dumps(tiny_snapshot(), protocol=4))
    said = run_cli(str(snapshot), "-o", str(tmp_path / "tiny.md"))
    assert said.returncode == 0, said.stderr
    text = " ".join(said.stdout.split())
    assert "highest reserved 2.00 MiB" in text and "reserved not recorded" not in text


WRONG_KINDS = {   # issue 33.8: what the file is, said in its own words, with what is accepted
    "a.csv": (b"col1,col2\n1,2\n3,4\n", "looks like CSV (text in columns)"),
    "a.tsv": (b"step\tbytes\n1\t2\n", "looks like tab-separated values"),
    "notes.txt": (b"hello world\nthis is a log\n", "looks like text (it starts 'hello world')"),
    "page.html": (b"<!DOCTYPE html><html><body>report</body></html>", "looks like an HTML page"),
    "chart.png": (b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR", "looks like a PNG image"),
    "photo.jpg": (b"\xff\xd8\xff\xe0\0\x10JFIF", "looks like a JPEG image"),
    "model.pt": (b"PK\x03\x04\x14\0\0\0", "looks like a zip archive (torch.save writes these"),
    "config.json": (b'{"name": "x", "values": [1, 2]}', "looks like JSON without traceEvents"),
}


@pytest.mark.parametrize("name", sorted(WRONG_KINDS))
def test_the_wrong_kind_of_file_is_named_for_what_it_is(tmp_path: Path, name: str) -> None:
    content, said = WRONG_KINDS[name]
    path = tmp_path / name
    path.write_bytes(content)
    run = run_cli(str(path), "-o", str(tmp_path / "r.html"))
    assert run.returncode == 2 and len(run.stderr.strip().splitlines()) == 1
    assert said in run.stderr and "pickle" in run.stderr.split(said)[1]   # then what is accepted
    assert "the pickle asks to import" not in run.stderr and "truncated" not in run.stderr


def test_text_that_opens_like_a_protocol_0_pickle_is_still_read_as_one(tmp_path: Path) -> None:
    """The other side: a protocol 0 pickle is text too; one that imports code is still refused as a pickle."""
    path = tmp_path / "old.pickle"
    path.write_bytes(b"cos\nsystem\n(S'echo hi'\ntR.")
    run = run_cli(str(path), "-o", str(tmp_path / "r.html"))
    assert run.returncode == 2 and "asks to import os.system" in run.stderr
