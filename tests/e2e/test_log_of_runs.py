"""The log of runs end to end: `analyze FILE --log` twice on a before/after pair one remedy apart, then
`analyze log`: the measured saving is the difference of the two peaks, beside the saving the first run predicted.

The pairs: a simulated GPT training run and the same run with its micro-batch halved (analyzer.simulate.remedy_runs,
as tests/e2e/test_remedy_replay_runs.py makes them), and the fixtures' fragmentation OOM and its run with
expandable segments (an allocator setting: its prediction is reserved memory given back).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from analyzer.commands import main
from analyzer.core.units import human_bytes
from analyzer.simulate.gpt import GPTConfig
from analyzer.simulate.remedy_runs import REMEDY_RUNS, RemedySetup, simulate
from tests.support.paths import SIM

SMALL = RemedySetup("eager d256 L4 s512 b4", GPTConfig(vocab=8000, d_model=256, layers=4, heads=4, max_seq=512),
                    batch=4, seq=512)


def _run(argv: list[str], capsys) -> tuple[int, str, str]:
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture(scope="module")
def micro_batch_pair(tmp_path_factory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("micro_batch")
    simulate(SMALL, folder / "before.pickle")
    simulate(REMEDY_RUNS["micro_batch"](SMALL), folder / "after.pickle")
    return folder / "before.pickle", folder / "after.pickle"


def _document(path: Path, capsys, *extra: str) -> dict:
    code, out, _ = _run([str(path), "--format", "json", *extra], capsys)
    assert code == 0
    return json.loads(out)


def test_a_before_after_pair_shows_the_measured_saving_beside_the_predicted_one(micro_batch_pair, tmp_path, capsys):
    before, after = micro_batch_pair
    log = tmp_path / "runs.jsonl"
    for path, note in ((before, "baseline, batch 4"), (after, "micro_batch: batch 4 -> 2")):
        code, _, err = _run([str(path), "-q", "-o", str(tmp_path / f"{path.stem}.html"), "--log", str(log),
                             "--note", note], capsys)
        assert code == 0, err
    assert len(log.read_text().splitlines()) == 2
    b, a = (_document(p, capsys)["devices"][0] for p in (before, after))
    assert b["oom"] is None and a["oom"] is None   # no OOM: the memory needed is the allocated peak
    peak_difference = b["peak"]["allocated_bytes"] - a["peak"]["allocated_bytes"]
    predicted = next(r for r in b["remedies"] if r["id"] == "micro_batch")["saved_bytes"]
    assert peak_difference > 0 and predicted > 0

    code, out, _ = _run(["log", str(log), "--format", "json"], capsys)
    assert code == 0
    shown = json.loads(out)
    assert [r["note"] for r in shown["runs"]] == ["baseline, batch 4", "micro_batch: batch 4 -> 2"]
    [pair] = shown["pairs"]
    [device] = pair["devices"]
    assert (pair["before_line"], pair["after_line"], pair["change"]) == (1, 2, "note names micro_batch")
    assert device["measured_saving_bytes"] == peak_difference
    assert device["predicted_saving_bytes"] == predicted
    assert device["ratio"] == pytest.approx(peak_difference / predicted)

    code, out, _ = _run(["log", str(log)], capsys)
    assert code == 0
    line = next(line for line in out.splitlines() if "measured saving" in line)
    assert human_bytes(peak_difference) in line and human_bytes(predicted) in line   # side by side

    page = tmp_path / "log.html"
    assert _run(["log", str(log), "-o", str(page)], capsys)[0] == 0
    html = page.read_text()
    assert "<svg" in html and "<script" not in html and human_bytes(peak_difference) in html


def test_the_environment_names_the_log_and_an_oom_gone_is_measured_in_reserved_memory(tmp_path, capsys,
                                                                                        monkeypatch):
    log = tmp_path / "runs.jsonl"
    monkeypatch.setenv("ANALYZER_RUN_LOG", str(log))
    for name, note in (("fragmentation", None), ("expandable", "expandable-segments on")):
        argv = [str(SIM / f"{name}.pickle"), "--gpu-memory", "22GiB", "-q", "-o", str(tmp_path / f"{name}.html")]
        assert _run(argv + (["--note", note] if note else []), capsys)[0] == 0
    monkeypatch.delenv("ANALYZER_RUN_LOG")
    b, a = (_document(SIM / f"{n}.pickle", capsys, "--gpu-memory", "22GiB")["devices"][0]
            for n in ("fragmentation", "expandable"))
    code, out, _ = _run(["log", str(log), "--format", "json"], capsys)
    assert code == 0
    [pair] = json.loads(out)["pairs"]
    [device] = pair["devices"]
    assert device["remedy"] == "expandable_segments" and device["measure"] == "reserved"
    assert (device["oom_before"], device["oom_after"]) == (True, False)
    assert device["measured_saving_bytes"] == b["reserved_peak_bytes"] - a["reserved_peak_bytes"]
    assert device["needed_saving_bytes"] == b["demand_bytes"] - a["demand_bytes"]
    assert device["predicted_saving_bytes"] == next(r for r in b["remedies"]
                                                    if r["id"] == "expandable_segments")["saved_bytes"]
    assert "OOM gone" in _run(["log", str(log)], capsys)[1]


@pytest.mark.parametrize("where", ["missing folder", "a directory", "a device"])
def test_a_log_that_cannot_be_written_is_one_line_and_exit_2(where, tmp_path, capsys):
    path = {"missing folder": tmp_path / "no" / "runs.jsonl", "a directory": tmp_path,
            "a device": Path("/dev/full")}[where]
    if where == "a device" and not path.exists():
        pytest.skip("no /dev/full on this system")
    code, out, err = _run([str(SIM / "healthy.pickle"), "-q", "-o", str(tmp_path / "r.html"), "--log", str(path)],
                          capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert str(path) in err and {"missing folder": "does not exist", "a directory": "is a directory",
                                 "a device": "is not a regular file"}[where] in err   # only a file is a log


def test_log_wins_over_the_environment_and_an_empty_variable_is_unset(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("ANALYZER_RUN_LOG", str(tmp_path))   # a directory: would be exit 2 if it were used
    argv = [str(SIM / "healthy.pickle"), "-q", "-o", str(tmp_path / "r.html")]
    assert _run(argv + ["--log", str(tmp_path / "given.jsonl"), "--note", "given"], capsys)[0] == 0
    assert json.loads((tmp_path / "given.jsonl").read_text())["note"] == "given"
    assert _run(argv, capsys)[0] == 2
    monkeypatch.setenv("ANALYZER_RUN_LOG", "")
    assert _run(argv, capsys)[0] == 0 and sorted(p.name for p in tmp_path.glob("*.jsonl")) == ["given.jsonl"]


def test_a_note_without_a_log_is_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("ANALYZER_RUN_LOG", raising=False)
    code, _, err = _run([str(SIM / "healthy.pickle"), "-q", "-o", str(tmp_path / "r.html"), "--note", "x"], capsys)
    assert code == 2 and "--note" in err and "ANALYZER_RUN_LOG" in err and len(err.strip().splitlines()) == 1


def test_malformed_lines_are_skipped_by_number_and_a_log_of_only_bad_lines_is_exit_2(tmp_path, capsys):
    log = tmp_path / "runs.jsonl"
    assert _run([str(SIM / "healthy.pickle"), "-q", "-o", str(tmp_path / "r.html"), "--log", str(log)], capsys)[0] == 0
    good = log.read_text()
    log.write_text("{cut\n" + good + '{"schema": "analyzer-run-log/1"}\n')
    code, out, err = _run(["log", str(log), "--format", "json"], capsys)   # the table wraps long paths
    assert code == 0 and [run["input"].endswith("healthy.pickle") for run in json.loads(out)["runs"]] == [True]
    assert [line for line in err.splitlines() if "skipped" in line] == [
        f"analyze log: warning: {log}: skipped line 1: not JSON (a cut or edited line)",
        f"analyze log: warning: {log}: skipped line 3: no time"]
    log.write_text("{cut\n[1, 2]\n")
    code, out, err = _run(["log", str(log)], capsys)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "holds no run" in err and "2 lines, 2 malformed" in err
    code, _, err = _run(["log", str(tmp_path / "absent.jsonl")], capsys)
    assert code == 2 and "no such run log" in err
