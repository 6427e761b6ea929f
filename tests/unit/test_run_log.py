"""The run log's line, its appending and reading, the pairing rule and the escaping of what a log holds."""
from __future__ import annotations

import copy
import io
import json
import os
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from analyzer.errors import CorruptInput, InputNotFound, OutputError
from analyzer.pipeline import analyze
from analyzer.report.run_log import SCHEMA, Run, RunLog, appending, log_line, read_log
from analyzer.report.run_log_render import print_log, render_log_html
from analyzer.report.run_pairs import named_remedies, pair_runs
from tests.support.paths import SIM

GiB = 1 << 30


@pytest.fixture(scope="module")
def documents() -> dict[str, dict[str, Any]]:
    """analyzer/1 documents of two fixtures: a training run that ran out of memory (fragmentation, on 22 GiB)
    and one that fits (healthy)."""
    return {"fragmentation": analyze(SIM / "fragmentation.pickle", 22 * GiB).to_json(),
            "healthy": analyze(SIM / "healthy.pickle").to_json()}


def test_a_line_holds_what_the_analysis_showed(documents):
    doc = documents["fragmentation"]
    now = datetime(2026, 12, 1, 14, 0, tzinfo=timezone.utc)
    line = log_line(doc, "first try", now)
    [d], [src] = line["devices"], doc["devices"]
    assert (line["schema"], line["time"], line["note"], line["input"]) == \
        (SCHEMA, "2026-12-01T14:00:00+00:00", "first try", doc["source"]["path"])
    assert d["oom"] is True and d["fits"] is False
    assert d["needed_bytes"] == src["demand_bytes"] > d["peak_allocated_bytes"]   # at an OOM: allocated + request
    assert sum(d["by_category"].values()) == d["peak_allocated_bytes"] == src["peak"]["allocated_bytes"]
    assert d["peak_reserved_bytes"] == src["reserved_peak_bytes"]
    assert {r["id"]: r["saved_bytes"] for r in d["remedies"]} == \
        {r["id"]: r["saved_bytes"] for r in src["remedies"] if r["saved_bytes"] is not None}
    assert {r["id"]: r["measure"] for r in d["remedies"]}["expandable_segments"] == "reserved"
    assert {r["id"]: r["measure"] for r in d["remedies"]}["micro_batch"] == "needed"
    config = line["config"]
    assert config["precision"] == src["theory"]["regime"] and config["workload"] == src["workload"]["kind"]
    assert config["steps"] == len(src["steps"]) and config["devices"] == 1
    assert config["gpus"] is None   # neither --gpus nor a world size in the snapshot: not guessed
    fits = log_line(documents["healthy"], None)["devices"][0]
    assert fits["oom"] is False and fits["needed_bytes"] == fits["peak_allocated_bytes"]
    assert datetime.fromisoformat(log_line(doc, None)["time"]).utcoffset().total_seconds() == 0


def test_two_logs_open_at_once_append_without_overwriting(documents, tmp_path):
    """O_APPEND: each write lands at the end, whoever wrote last (a plain write at each one's offset would not)."""
    path = tmp_path / "runs.jsonl"
    line = log_line(documents["healthy"], None)
    with appending(path) as first, appending(path) as second:
        for i in range(3):
            first({**line, "note": f"first {i}"})
            second({**line, "note": f"second {i}"})
    notes = [r.record["note"] for r in read_log(path).runs]
    assert notes == ["first 0", "second 0", "first 1", "second 1", "first 2", "second 2"]


def test_an_unwritable_log_is_one_error(tmp_path):
    if os.geteuid() == 0:   # root writes any file: a sysfs file without a write method refuses even root
        path = Path("/sys/kernel/notes")
        if not path.exists():
            pytest.skip("root, and no /sys/kernel/notes to refuse the write")
    else:
        path = tmp_path / "runs.jsonl"
        path.write_text("")
        path.chmod(0o444)
    with pytest.raises(OutputError, match="permission denied"):
        with appending(path):
            pass


def _write_log(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(f"{line}\n" for line in lines))
    return path


def test_reading_skips_each_malformed_line_by_number(documents, tmp_path):
    good = log_line(documents["healthy"], None)
    device_without_peak = copy.deepcopy(good)
    del device_without_peak["devices"][0]["needed_bytes"]
    boolean_rank = copy.deepcopy(good)
    boolean_rank["devices"][0]["rank"] = True
    lines = [json.dumps(good), "", "{cut", json.dumps({**good, "schema": "other/1"}), json.dumps(device_without_peak),
             json.dumps({**good, "note": 3}), json.dumps(boolean_rank), "[" * 100_000, json.dumps(good)]
    log = read_log(_write_log(tmp_path / "runs.jsonl", lines))
    assert [r.line for r in log.runs] == [1, 9]
    assert log.skipped == ["line 3: not JSON (a cut or edited line)", "line 4: not a record of analyzer-run-log/1",
                           "line 5: a device without needed_bytes", "line 6: a note that is not text",
                           "line 7: a device whose rank is not a number", "line 8: not JSON (a cut or edited line)"]


def test_a_log_without_runs_is_one_error(tmp_path):
    with pytest.raises(CorruptInput, match=r"holds no run the analyzer logged \(2 lines, 2 malformed; line 1"):
        read_log(_write_log(tmp_path / "bad.jsonl", ["{cut", "3"]))
    with pytest.raises(CorruptInput, match=r"\(0 lines, 0 malformed\)"):
        read_log(_write_log(tmp_path / "empty.jsonl", []))
    with pytest.raises(InputNotFound, match="is a directory"):
        read_log(tmp_path)
    with pytest.raises(InputNotFound, match="no such run log"):
        read_log(tmp_path / "absent.jsonl")


def _run(line: int, record: dict[str, Any], note: str | None = None, needed_less: int = 0,
         **config: Any) -> Run:
    """A logged run made from a real line: its note, its configuration and its device's memory changed."""
    record = copy.deepcopy(record)
    record["note"] = note
    record["config"].update(config)
    record["devices"][0]["needed_bytes"] -= needed_less
    return Run(line, record)


def _saved(record: dict[str, Any], remedy: str) -> int:
    return next(r["saved_bytes"] for r in record["devices"][0]["remedies"] if r["id"] == remedy)


def test_a_note_pairs_with_the_nearest_earlier_run_that_offered_the_remedy(documents):
    base = log_line(documents["fragmentation"], None)
    without = copy.deepcopy(base)
    without["devices"][0]["remedies"] = [r for r in without["devices"][0]["remedies"] if r["id"] != "micro_batch"]
    saved = _saved(base, "micro_batch")
    after = _run(4, base, "halved: micro-batch", needed_less=saved)
    runs = [_run(1, base), _run(2, base), _run(3, without), after, _run(5, after.record, "micro_batch again")]
    [pair, again] = pair_runs(runs)
    assert (pair.before.line, pair.after.line, pair.change) == (2, 4, "note names micro_batch")
    assert (again.before.line, again.after.line) == (2, 5)   # run 4 is after the change too: not the run before
    [d] = pair.devices
    assert d.measured_saving_bytes == saved == d.predicted_saving_bytes and d.ratio == 1.0
    assert named_remedies("ZeRO-3 (zero3) and activation-checkpointing") >= {"zero3", "activation_checkpointing"}


def test_a_note_naming_two_remedies_pairs_without_a_prediction(documents):
    base = log_line(documents["fragmentation"], None)
    [pair] = pair_runs([_run(1, base), _run(2, base, "zero3 + bf16", needed_less=GiB)])
    assert pair.change == "note names bf16, zero3"
    assert pair.devices[0].predicted_saving_bytes is None and pair.devices[0].measured_saving_bytes == GiB


def test_one_configuration_variable_apart_is_a_pair_checked_against_the_remedy_that_changes_it(documents):
    base = log_line(documents["fragmentation"], None)
    zero3 = _saved(base, "zero3")
    [pair] = pair_runs([_run(1, base, gpus=1), _run(2, base, gpus=4, needed_less=zero3)])
    assert pair.change == "gpus 1 -> 4"
    [d] = pair.devices
    assert d.remedy is not None and d.remedy["id"] == "zero3"      # the closest of zero1, zero2, zero3, TP
    assert d.how == "closest estimate among zero1, zero2, zero3, tensor_parallel" and d.ratio == 1.0
    [other] = pair_runs([_run(1, base, frozen_share=0.9), _run(2, base, frozen_share=0.5, needed_less=GiB)])
    assert other.change == "frozen_share 0.9 -> 0.5" and other.devices[0].remedy is None


def test_two_variables_apart_or_an_unknown_one_is_no_pair(documents):
    base = log_line(documents["fragmentation"], None)
    assert pair_runs([_run(1, base, gpus=1, autocast=False), _run(2, base, gpus=4, autocast=True)]) == []
    assert pair_runs([_run(1, base, gpus=None), _run(2, base, gpus=4)]) == []    # unknown is no difference
    assert pair_runs([_run(1, base), _run(2, base)]) == []                       # nothing changed


def test_what_a_log_holds_is_escaped_in_the_terminal_and_the_page(documents):
    hostile = {**log_line(documents["healthy"], "<script>alert(1)</script> \x1b[31mred\x1b]0;t\x07"),
               "input": "<b>run</b>\x1b[2J.pickle"}
    log = RunLog([Run(1, hostile)])
    out = io.StringIO()
    print_log(log, [], Console(file=out, width=200, color_system=None))
    text = out.getvalue()
    assert "\x1b" not in text and "\x07" not in text and "\\x1b[31mred" in text and "<b>run</b>" in text
    page = render_log_html(log, [])
    assert "<script" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page and "&lt;b&gt;run" in page
    assert "\x1b" not in page.replace("\\x1b", "")
