"""The terminal summary at 80 and 200 columns on five real recordings (issue 33.4): no line ends in spaces,
wrapped lines keep their indent, no `file:line` or number is cut, each verdict is said once, and nothing
meaningless ('event -1', 'kineto, kineto', '0.00 GiB', a plan that repeats the list) is printed."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

from tests.support.paths import REAL, ROOT

FIVE = ["constructor-sun-code_location/memory_snapshot.pickle", "hta/df_index_resolver.json.gz",
        "wedsonlin-cs336-a2/medium_1024_training_memory_snapshot.pickle",
        "kineto-tb_plugin/resnet50_num_workers_0/worker0.1623143089861.pt.trace.json.gz",
        "yiyi-llm-inference/oom_snapshot.pickle"]
_FILE_LINE = re.compile(r"[\w.-]+\.py:\d+")


@cache
def summary(name: str, columns: int, out: Path) -> str:
    run = subprocess.run([sys.executable, "-m", "analyzer", str(REAL / name), "-o", str(out / "r.html")],
                         capture_output=True, text=True, cwd=ROOT, timeout=300,
                         env={**os.environ, "COLUMNS": str(columns), "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0, run.stderr
    return run.stdout


@pytest.fixture(scope="module")
def out(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("reports")


@pytest.mark.skipif(not REAL.is_dir(), reason=f"real recordings not found at {REAL}")
@pytest.mark.parametrize("name", FIVE)
def test_reads_well_at_80_columns(name: str, out: Path) -> None:
    narrow, wide = summary(name, 80, out), summary(name, 200, out)
    for text, width in ((narrow, 80), (wide, 200)):
        lines = text.splitlines()
        assert not [line for line in lines if line != line.rstrip()], f"{name} at {width}: lines end in spaces"
        assert all(len(line) <= width for line in lines), f"{name} at {width}: a line is wider than the terminal"
        for meaningless in ("event -1 ", "kineto, kineto", " 0.00 GiB", "-0.00 GiB", "first of 1 "):
            assert meaningless not in text, (name, width, meaningless)
        assert not re.search(r"\d…", text), f"{name} at {width}: a number is cut"
    assert set(_FILE_LINE.findall(wide)) <= set(_FILE_LINE.findall(narrow)), f"{name}: a file:line is cut at 80"
    lines = narrow.splitlines()
    for i, line in enumerate(lines):   # a wrapped line keeps its item's indent: remedies, bullets, warnings
        if line.startswith(("what to change", "optional: ways")):
            items = lines[i + 1:next(j for j in range(i + 1, len(lines)) if lines[j].startswith("  end: "))]
            assert all(re.match(r"\d+\. |  ", item) for item in items), f"{name}: {items}"
        if line.startswith("  - ") and i + 1 < len(lines) and lines[i + 1]:
            assert lines[i + 1].startswith(("  - ", "    ")), f"{name}: {lines[i + 1]!r} lost its indent"
        if line.startswith("warning: ") and i + 1 < len(lines) and lines[i + 1]:
            assert lines[i + 1].startswith(("warning: ", "         ", "report written")), f"{name}: {lines[i + 1]!r}"
    squashed = " ".join(narrow.split())
    verdict = " ".join(narrow.split(f"\n{REAL}")[0].split())   # the first line(s), up to the input line
    assert squashed.count(verdict) == 1, f"{name}: the verdict is said more than once"
    if "plan: one change at a time" in narrow:   # a plan of several changes, never one that repeats the list
        plan = narrow.split("plan: one change at a time")[1].split("\n")
        assert sum(1 for line in plan if re.match(r"\d+\. ", line)) >= 2


def test_cut_text_keeps_the_line_number_and_whole_numbers() -> None:
    from analyzer.report.text import _left_cut, _right_cut

    frame = "…/site-packages/transformers/modeling_utils.py:4346 to"
    assert _left_cut(frame, len(frame)) == frame
    assert _left_cut(frame, 30).endswith("modeling_utils.py:4346 to") and len(_left_cut(frame, 30)) == 30
    op = "no user frame; aten::mm(float[32, 4096], float[4096, 4096])"
    assert _right_cut(op, len(op)) == op
    assert _right_cut(op, 40) == "no user frame; aten::mm(float[32, …"
    assert len(_right_cut(op, 40)) <= 40
