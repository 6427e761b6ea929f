"""Every Python block of the README and the docs runs here, and every output they quote is the tool's own.

A ```python block is preceded by one of two markers (an HTML comment, invisible once rendered):

- `<!-- example -->`: it runs, from the repository root, after the file's earlier examples (one namespace per
  page); when the next block is preceded by `<!-- output -->`, what the example printed must be that block.
- `<!-- not run: why -->`: it needs what a test cannot have (a GPU, a training script); the reason is said.

A block quoting the command line is preceded by `<!-- output of: analyze ARGS -->`: the command runs and each
quoted piece (pieces separated by `...`; a `$ ` line, the prompt, is left out) must appear in its output, in
order, whitespace aside (the terminal wraps at its own width).
An unmarked Python block fails: an example nobody runs is how the README's came to be wrong.
"""
from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import pytest

from analyzer.commands import COMMANDS
from tests.support.paths import REAL, ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
_FENCE = re.compile(r"^```(\S*)")
_MARK = re.compile(r"^<!--\s*(example|output|not run:.*|output of:.*?)\s*-->$")


@dataclass
class Block:
    page: Path
    line: int        # 1-based line of the opening fence
    language: str
    mark: str | None  # the marker comment right above it, if any
    text: str


def blocks(page: Path) -> list[Block]:
    """The fenced blocks of a page with the marker just above each."""
    out, lines, i = [], page.read_text(encoding="utf-8").splitlines(), 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        above = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        mark = _MARK.match(above)
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        out.append(Block(page, i + 1, fence.group(1), mark.group(1) if mark else None, "\n".join(lines[i + 1:end])))
        i = end + 1
    return out


def _id(page: Path) -> str:
    return str(page.relative_to(ROOT))


def _needs_real(text: str) -> bool:
    return "../shared/real" in text


@pytest.mark.parametrize("page", PAGES, ids=_id)
def test_every_python_block_is_marked(page: Path) -> None:
    unmarked = [b.line for b in blocks(page) if b.language == "python"
                and not (b.mark == "example" or (b.mark or "").startswith("not run:"))]
    assert not unmarked, f"{_id(page)}: Python blocks at lines {unmarked} say neither <!-- example --> nor " \
                         "<!-- not run: why -->"


def _examples(page: Path) -> list[tuple[Block, Block | None]]:
    found = blocks(page)
    return [(b, found[k + 1] if k + 1 < len(found) and found[k + 1].mark == "output" else None)
            for k, b in enumerate(found) if b.language == "python" and b.mark == "example"]


@pytest.mark.parametrize("page", [p for p in PAGES if _examples(p)], ids=_id)
def test_examples_run_and_print_what_the_page_shows(page: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    examples = _examples(page)
    if any(_needs_real(b.text) for b, _ in examples) and not REAL.is_dir():
        pytest.skip(f"{REAL} is absent: the examples of {_id(page)} read the real recordings there")
    monkeypatch.chdir(ROOT)
    namespace: dict[str, object] = {"__name__": "__doc_example__"}
    with pd.option_context("display.width", 80, "display.max_columns", 20):
        for block, shown in examples:
            printed = io.StringIO()
            with contextlib.redirect_stdout(printed):
                exec(compile(block.text, f"{_id(page)}:{block.line}", "exec"), namespace)
            if shown is not None:
                got = [line.rstrip() for line in printed.getvalue().rstrip("\n").splitlines()]
                assert got == [line.rstrip() for line in shown.text.splitlines()], \
                    f"{_id(page)}:{shown.line}: the example at line {block.line} prints:\n" + "\n".join(got)


def _quotes() -> list[tuple[Block, str]]:
    return [(b, b.mark[len("output of:"):].strip()) for page in PAGES for b in blocks(page)
            if b.mark and b.mark.startswith("output of:")]


def _squash(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.parametrize("block,command", _quotes(), ids=lambda v: f"{_id(v.page)}:{v.line}" if isinstance(v, Block) else "")
def test_quoted_outputs_are_the_tools(block: Block, command: str, tmp_path: Path) -> None:
    args = command.split()
    assert args[0] == "analyze", f"{_id(block.page)}:{block.line}: quotes `{command}`, not an analyze command"
    if _needs_real(command) and not REAL.is_dir():
        pytest.skip(f"{REAL} is absent: {command} reads a real recording there")
    writes = args[1] not in COMMANDS and "-o" not in args   # `analyze FILE` writes a report beside its input
    report = ["-o", str(tmp_path / "report.html")] if writes else []
    run = subprocess.run([sys.executable, "-m", "analyzer", *args[1:], *report], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "COLUMNS": "200", "PYTHONPATH": str(ROOT)}, timeout=600)
    said = _squash(run.stdout)
    at = 0
    quote = "\n".join(line for line in block.text.splitlines() if not line.startswith("$ "))  # the prompt
    for piece in quote.split("..."):
        quoted = _squash(piece)
        if not quoted:
            continue
        found = said.find(quoted, at)
        assert found >= 0, f"{_id(block.page)}:{block.line} quotes\n{quoted}\nbut `{command}` printed\n{run.stdout}"
        at = found + len(quoted)
