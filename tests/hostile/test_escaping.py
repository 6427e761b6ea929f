"""Strings from a hostile input, in every field that can reach a report, stay text in every registered format.

Each field gets its own tagged payload (markup, an event handler, Markdown links and images, autolinks, a
javascript: URL, mentions, a new line). The snapshot carries them in frames, module and phase annotations,
user_metadata, allocator settings and its own file name; the profiler trace in Python frames, annotations and
the device name; the Nsight export in NVTX text, the GPU name, kernel names and the program's captured stderr.
A text log carries them in a traceback's file and function, a process name in `nvidia-smi`'s table and a
`PYTORCH_CUDA_ALLOC_CONF` setting, and is rendered by every reporter of a log's analysis (`LOG_REPORTERS`).
Every report (HTML, Markdown rendered by GitHub's cmark-gfm, PDF) is compared with the report of a benign twin
of the same input: no tag, attribute or link that the benign report lacks, no attribute or URL pointing
anywhere, and the payloads visible as text.
"""
from __future__ import annotations

import pickle
import shutil
import sqlite3
import subprocess
from collections import Counter
from collections.abc import Callable
from html.parser import HTMLParser
from pathlib import Path

import pytest

from analyzer.log_result import LogAnalysis, analyze_log
from analyzer.pipeline import analyze
from analyzer.report import LOG_REPORTERS, REPORTERS, reporter
from analyzer.result import Analysis
from hostile.make_corpus import chrome_trace, tiny_snapshot
from support.paths import FIXTURES

FORMATS = sorted(f for f in REPORTERS if f != "json")
REFERENCES = ("evil.example", "javascript:", "alert(")
#: attributes whose value is a URL, code or style: input text must never reach one
_ACTIVE = {"href", "src", "srcset", "action", "formaction", "xlink:href", "style", "background", "poster", "data"}
#: elements that load, run or link something: a report must hold exactly as many as its benign twin's (an SVG
#: chart's <use> glyphs vary with the text drawn; their href is checked with the other active attributes)
_LIVE = {"script", "style", "img", "a", "iframe", "object", "embed", "link", "meta", "base", "form", "svg", "image",
         "foreignobject", "video", "audio", "source"}


def payload(tag: str) -> str:
    return (f'<script>alert("{tag}")</script><img src=x onerror=alert("{tag}")>[{tag}](https://evil.example/{tag}) '
            f"![{tag}](https://evil.example/{tag}.png) <https://evil.example/{tag}> www.evil.example "
            f"javascript:alert(1) @{tag} #{tag} **{tag}** |{tag}| `x`\n# {tag}")


def benign(tag: str) -> str:
    return f"benign_{tag}"


# ---- inputs -------------------------------------------------------------------------------------------------
def snapshot(text: Callable[[str], str], folder: Path) -> Path:
    s = tiny_snapshot()
    frames = [{"filename": f"/home/u/{text('FRAMEFILE')}.py", "line": 12, "name": text("FUNCTION")},
              {"filename": "/home/u/train.py", "line": 40, "name": "main"}]
    for entry in s["device_traces"][0]:
        entry["frames"] = frames
        entry["user_metadata"] = f"module::forward::{text('METADATA')}" if entry["action"] == "alloc" else ""
    s["device_traces"][0].append({"action": "oom", "addr": 0, "size": 1 << 30, "stream": 0, "time_us": 8,
                                  "frames": frames, "device_free": 1 << 20})
    s["segments"][0]["blocks"][1]["frames"] = frames
    s["allocator_settings"]["PYTORCH_CUDA_ALLOC_CONF"] = text("ALLOCCONF")
    s["external_annotations"] = [{"device": 0, "name": name, "stage": stage, "time_us": t}
                                 for name in (f"module::forward::{text('MODULE')}", text("ANNOTATION"))
                                 for stage, t in (("START", 1), ("END", 9))]
    path = folder / f"{text('FILENAME')[:120].replace('/', '_').replace(chr(10), ' ')}.pickle"
    path.write_bytes(pickle.dumps(s, protocol=4))
    return path


def profiler_trace(text: Callable[[str], str], folder: Path) -> Path:
    import json

    t = chrome_trace()
    t["deviceProperties"][0]["name"] = text("GPUNAME")
    for event in t["traceEvents"]:
        if event["cat"] == "python_function":
            event["name"] = f"/home/u/{text('PYFILE')}.py(12): {text('PYFUNCTION')}"
        elif event["cat"] == "user_annotation":
            event["dur"] = 100.0
    t["traceEvents"].append({"ph": "X", "cat": "user_annotation", "name": f"module::forward::{text('KMODULE')}",
                             "pid": 1, "tid": 1, "ts": 8.0, "dur": 10.0, "args": {}})
    path = folder / "trace.pt.trace.json"
    path.write_text(json.dumps(t))
    return path


def nsys_export(text: Callable[[str], str], folder: Path) -> Path:
    path = folder / "run.sqlite"
    shutil.copy(FIXTURES / "nsys" / "oom_with_nccl.sqlite", path)
    with sqlite3.connect(path) as db:
        db.execute("UPDATE NVTX_EVENTS SET text = ?", (text("NVTX"),))
        db.execute("UPDATE TARGET_INFO_GPU SET name = ?", (text("NSYSGPU"),))
        db.execute("UPDATE StringIds SET value = ? WHERE id IN (SELECT shortName FROM CUPTI_ACTIVITY_KIND_KERNEL)",
                   (text("KERNEL"),))
        top = db.execute("SELECT MAX(id) FROM StringIds").fetchone()[0]
        db.executemany("INSERT INTO StringIds VALUES (?, ?)", [
            (top + 1, "/tmp/stderr.log"),
            (top + 2, f"Traceback (most recent call last):\n  File x\nRuntimeError: {text('STDERR')}")])
        db.execute("CREATE TABLE ProcessStreams (globalPid INTEGER, filenameId INTEGER, contentId INTEGER)")
        db.execute("INSERT INTO ProcessStreams VALUES (0, ?, ?)", (top + 1, top + 2))
    return path


def text_log(text: Callable[[str], str], folder: Path) -> Path:
    """An OOM with its traceback, the process table of nvidia-smi and an allocator setting: a log's lines hold no
    line break, so each payload's becomes a space (and a double quote, which would close the traceback's quoted
    file name, a single one)."""
    def one_line(tag: str) -> str:
        return text(tag).replace("\n", " ").replace('"', "'")

    lines = ["Traceback (most recent call last):",
             f'  File "/home/u/{one_line("LOGFILE")}.py", line 12, in {one_line("LOGFUNCTION")}',
             "    loss = model(batch)",
             "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
             "23.65 GiB of which 1.00 GiB is free. Process 4242 has 3.00 GiB memory in use. Including non-PyTorch "
             "memory, this process has 19.00 GiB memory in use. Of the allocated memory 17.00 GiB is allocated by "
             "PyTorch, and 1.00 GiB is reserved by PyTorch but unallocated. If reserved but unallocated memory is "
             "large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.",
             f"PYTORCH_CUDA_ALLOC_CONF={one_line('LOGSETTING')}",
             "+-----------------------------------------------------------------------------+",
             "| Processes:                                                       GPU Memory |",
             "|  GPU       PID   Type   Process name                             Usage      |",
             "|=============================================================================|",
             f"|    0      4242      C   {one_line('PROCESS')[:40]}   3072MiB |",
             "+-----------------------------------------------------------------------------+"]
    path = folder / "train.log"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


INPUTS = {"snapshot": snapshot, "profiler_trace": profiler_trace, "nsys_export": nsys_export}
LOG_INPUTS = {"text_log": text_log}


# ---- what a rendered document contains ----------------------------------------------------------------------
class _Elements(HTMLParser):
    """Tags (and how many of the live ones), attribute names, active attribute values, and the text outside
    scripts and styles of an HTML document."""

    def __init__(self, html: str) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: set[str] = set()
        self.live: Counter[str] = Counter()
        self._inside: list[str] = []
        self.attributes: set[str] = set()
        self.active: list[str] = []  # values of attributes that act (URLs, handlers, styles)
        self.text: list[str] = []
        self.feed(html)
        self.close()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.add(tag)
        if tag in _LIVE:
            self.live[tag] += 1
        if tag in ("script", "style"):
            self._inside.append(tag)
        for name, value in attrs:
            self.attributes.add(name)
            if name in _ACTIVE or name.startswith("on"):
                self.active.append(value or "")

    def handle_endtag(self, tag: str) -> None:
        if self._inside and self._inside[-1] == tag:
            self._inside.pop()

    def handle_data(self, data: str) -> None:
        if not self._inside:
            self.text.append(data)


def _html_of(fmt: str, analysis: Analysis | LogAnalysis, folder: Path) -> tuple[str, list[str]]:
    """(the report as HTML, URLs of its links where the format has them) for one format."""
    out = folder / f"report.{fmt}"
    written = reporter(fmt, LOG_REPORTERS if isinstance(analysis, LogAnalysis) else REPORTERS)(analysis, out)
    assert out in written
    if fmt == "html":
        return out.read_text(encoding="utf-8"), []
    if fmt == "md":
        cmarkgfm = pytest.importorskip("cmarkgfm", reason="cmarkgfm (GitHub's renderer) is in the `test` extra")
        from cmarkgfm.cmark import Options

        return cmarkgfm.github_flavored_markdown_to_html(out.read_text(encoding="utf-8"),
                                                         options=Options.CMARK_OPT_UNSAFE), []
    if fmt == "pdf":
        if not shutil.which("pdftotext") or not shutil.which("pdfinfo"):
            pytest.skip("poppler's pdftotext and pdfinfo are needed to read the PDF")
        text = subprocess.run(["pdftotext", str(out), "-"], capture_output=True, text=True, check=True).stdout
        urls = subprocess.run(["pdfinfo", "-url", str(out)], capture_output=True, text=True, check=True).stdout
        return f"<pre>{_escape(text)}</pre>", urls.splitlines()[1:]
    pytest.fail(f"no check for the registered format {fmt!r}: add one here")


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


@pytest.fixture(scope="module")
def analyses(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Analysis | LogAnalysis, ...]]:
    """Per input kind: (the hostile analysis, its benign twin's)."""
    out: dict[str, tuple[Analysis | LogAnalysis, ...]] = {}
    for kind, make in INPUTS.items():
        hostile = analyze(make(payload, tmp_path_factory.mktemp(f"{kind}_hostile")))
        twin = analyze(make(benign, tmp_path_factory.mktemp(f"{kind}_benign")))
        out[kind] = (hostile, twin)
    for kind, make in LOG_INPUTS.items():
        out[kind] = tuple(analyze_log(make(text, tmp_path_factory.mktemp(f"{kind}_{name}")))
                          for name, text in (("hostile", payload), ("benign", benign)))
    return out


CASES = [(kind, fmt) for kind in sorted(INPUTS) for fmt in FORMATS] + \
        [(kind, fmt) for kind in sorted(LOG_INPUTS) for fmt in sorted(f for f in LOG_REPORTERS if f != "json")]


@pytest.mark.parametrize(("kind", "fmt"), CASES)
def test_hostile_strings_stay_text(kind: str, fmt: str, analyses: dict, tmp_path: Path) -> None:
    if fmt == "pdf":
        pytest.importorskip("weasyprint", reason="weasyprint is the optional extra `pdf`")
    hostile, twin = analyses[kind]
    (tmp_path / "h").mkdir()
    (tmp_path / "b").mkdir()
    html, urls = _html_of(fmt, hostile, tmp_path / "h")
    baseline, baseline_urls = _html_of(fmt, twin, tmp_path / "b")
    seen, expected = _Elements(html), _Elements(baseline)
    assert seen.tags <= expected.tags, f"new elements: {seen.tags - expected.tags}"
    assert seen.live == expected.live, f"live elements {dict(seen.live)} != {dict(expected.live)}"
    assert seen.attributes <= expected.attributes, f"new attributes: {seen.attributes - expected.attributes}"
    leaked = [v for v in seen.active if any(r in v for r in REFERENCES)]
    assert not leaked, f"input text inside URL, handler or style attributes: {leaked[:3]}"
    assert len(urls) == len(baseline_urls) and not any("evil" in u for u in urls), urls
    text = "".join("".join(seen.text).split())  # PDF lines break anywhere inside a frame
    shown = [tag for tag in _TAGS[kind] if f'alert("{tag}")' in text or f"alert('{tag}')" in text]
    assert shown or fmt == "md", f"no payload of {kind} is visible as text in the {fmt} report"  # md is a summary


_TAGS = {"text_log": ["LOGFILE", "LOGFUNCTION", "LOGSETTING", "PROCESS"],
         "snapshot": ["FRAMEFILE", "FUNCTION", "METADATA", "ALLOCCONF", "MODULE", "ANNOTATION", "FILENAME"],
         "profiler_trace": ["GPUNAME", "PYFILE", "PYFUNCTION", "KMODULE"],
         "nsys_export": ["NVTX", "NSYSGPU", "KERNEL", "STDERR"]}
