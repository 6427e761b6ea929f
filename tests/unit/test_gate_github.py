"""GitHub Actions output of a check, against the format GitHub documents.

"Workflow commands for GitHub Actions" (docs.github.com) gives an annotation as one line,
`::error file={name},line={line},title={title}::{message}`. Its data is escaped as actions/toolkit's
packages/core/src/command.ts escapes it (escapeData: `%` -> %25, CR -> %0D, LF -> %0A; escapeProperty also
`:` -> %3A and `,` -> %2C), which the runner decodes. Here each line is parsed by that grammar and decoded, and
must give back exactly the text the check says, and names taken from an input must be shown escaped
(`printable`), never as a second command or a line break of their own.
"""
from __future__ import annotations

import re

import pytest

from analyzer.core.printable import printable
from analyzer.gate import github
from analyzer.gate.compare import check_baseline, check_budget
from analyzer.gate.render import details, headline
from analyzer.gate.summary import DevicePeak, Kind, RunPeaks, Site

GiB = 2**30
# one command: `::name` then properties `key=value` separated by commas, then `::` and the message; a property
# value holds no `,` or `:` and no line break holds anywhere (they are escaped)
COMMAND = re.compile(r"^::(?P<name>[a-z]+)(?: (?P<props>[^:\r\n]*))?::(?P<message>[^\r\n]*)$")
DATA = {"%25": "%", "%0D": "\r", "%0A": "\n"}
PROPERTY = {**DATA, "%3A": ":", "%2C": ","}
HOSTILE = "layers.0\n::error::pwned %0A 100%, a:b\r\u202eevil|<script>"


def decode(text: str, table: dict[str, str]) -> str:
    """The runner's decoding: each escape replaced once, left to right (so %250A is a literal %0A)."""
    return re.sub("|".join(table), lambda m: table[m.group(0)], text)


def parse(line: str) -> tuple[str, dict[str, str], str]:
    m = COMMAND.match(line)
    assert m, f"not a workflow command line: {line!r}"
    props = dict(p.split("=", 1) for p in m.group("props").split(",")) if m.group("props") else {}
    return m.group("name"), {k: decode(v, PROPERTY) for k, v in props.items()}, decode(m.group("message"), DATA)


def test_escape_data_and_property_as_the_toolkit_does():
    assert github.escape_data("100%\r\nnext") == "100%25%0D%0Anext"
    assert github.escape_data("a:b,c") == "a:b,c"
    assert github.escape_property("cuda:0, 100%\n") == "cuda%3A0%2C 100%25%0A"
    assert github.command("error", "x", title="t:1") == "::error title=t%3A1::x"
    assert github.command("warning", "only a message") == "::warning::only a message"


@pytest.mark.parametrize("text", ["plain", "100% of it", "two\nlines", "cr\r\nlf", "%0A literal", "a:b, c::d"])
def test_every_message_and_property_decodes_back_to_itself(text):
    name, props, message = parse(github.command("error", text, title=text))
    assert (name, props, message) == ("error", {"title": text}, text)


def _peak(module: str = "layers.0", needed: int = 10 * GiB) -> DevicePeak:
    return DevicePeak(device=0, rank=None, needed_bytes=needed, peak_bytes=needed, reserved_bytes=None, oom=False,
                      step=3, phase="forward", module=module, by_category={"activation": needed},
                      by_phase={"forward": needed}, by_module={module: needed},
                      sites=(Site(module + ".py:1 forward", needed, 1),))


def test_a_failing_check_is_one_error_per_device_with_its_explanation_line_by_line():
    check = check_baseline(RunPeaks("new.pickle", Kind.RECORDING, (_peak(HOSTILE, 12 * GiB),)),
                           RunPeaks("old.json", Kind.BASELINE, (_peak(needed=10 * GiB),)))
    lines = github.annotation_lines(check)
    assert len(lines) == 1
    name, props, message = parse(lines[0])
    assert name == "error" and props == {"title": "GPU memory check failed on cuda:0"}
    assert message.split("\n") == [headline(check.devices[0], check), *details(check.devices[0], check)]
    # the hostile module name is in the message, escaped for a terminal: no line break, bidi override or
    # command of its own, and its literal %0A stays literal
    assert printable(HOSTILE) in message
    assert "\u202e" not in message and "\r" not in message
    assert all(not part.startswith("::") for part in message.split("\n"))


def test_a_stale_baseline_and_the_check_warnings_are_warnings():
    check = check_baseline(RunPeaks("new.pickle", Kind.RECORDING, (_peak(needed=8 * GiB),), ("a: warning, 100%",)),
                           RunPeaks("old.json", Kind.BASELINE, (_peak(needed=10 * GiB),)))
    assert check.holds
    parsed = [parse(line) for line in github.annotation_lines(check)]
    assert [(n, p["title"]) for n, p, _ in parsed] == [("warning", "GPU memory baseline stale on cuda:0"),
                                                       ("warning", "GPU memory check")]
    assert parsed[1][2] == "a: warning, 100%"


def test_a_holding_check_says_nothing_in_annotations():
    check = check_budget(RunPeaks("run.pickle", Kind.RECORDING, (_peak(needed=8 * GiB),)), 8 * GiB)
    assert github.annotation_lines(check) == []


def test_the_summary_renders_as_one_table_and_escapes_names_from_the_input():
    cmarkgfm = pytest.importorskip("cmarkgfm", reason="cmarkgfm (GitHub's renderer) is in the `test` extra")
    from cmarkgfm.cmark import Options

    check = check_budget(RunPeaks("run|<b>.pickle", Kind.RECORDING, (_peak(HOSTILE, 12 * GiB),)), 10 * GiB)
    html = cmarkgfm.github_flavored_markdown_to_html(github.summary_markdown(check),
                                                     options=Options.CMARK_OPT_UNSAFE)
    assert html.count("<table>") == 1 and html.count("<tr>") == 2   # the header and the one device
    assert re.findall(r"<td[^>]*>([^<]*)</td>", html) == ["cuda:0", "12.00 GiB", "", "10.00 GiB"]
    assert "<script>" not in html and "<b>" not in html and "\u202e" not in html
    assert "<strong>fails</strong>" in html
