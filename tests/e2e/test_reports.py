"""Reports: their content checked on the view-model every reporter renders; the HTML opened in headless Chromium
(no console errors, no request, every section); the PDF read back with pdftotext; the Markdown rendered by
GitHub's own renderer (cmark-gfm); and strings from a hostile input shown as text in every format."""
from __future__ import annotations

import copy
import functools
import pickle
import re
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
from rich.console import Console

import analyzer
from analyzer.commands import main
from analyzer.core.module_tree import OWN, module_tree
from analyzer.core.units import human_bytes
from analyzer.report.html import render_html, write_html
from analyzer.report.markdown import md_code, md_text, render_markdown, write_markdown
from analyzer.report.text import print_summary
from analyzer.report.view import CHART_POINTS, FRAMES_SHOWN, LIVE_SHOWN, build_view
from analyzer.result import (
    Analysis,
    Details,
    Diagnosis,
    Evidence,
    Finding,
    FragmentationPicture,
    FreeInSegment,
    KVCacheDetails,
    KVCacheFinding,
    OomDetails,
    OomFinding,
    RegimeCheck,
    Theory,
)
from support.chromium import Chromium, chromium_binary
from support.paths import FIXTURES, REAL

SIM = FIXTURES / "sim"
MAX_HTML_BYTES = 5 * 2**20
SCRIPT = "<script>alert(1)</script>"
LINK = "x](http://evil).py"
IMG = "<img src=x onerror=alert(1)>"


@functools.cache
def _analysis(path: Path) -> Analysis:
    return analyzer.analyze(path)


def analysis(path: Path) -> Analysis:
    """A fresh copy of a cached analysis: tests may set findings, remedies and verdicts on it."""
    return copy.deepcopy(_analysis(path))


def hostile_snapshot() -> dict:
    """A snapshot (torch 2.13 layout) whose frames, module annotation and allocator settings try to become markup:
    four allocations in one segment, two freed, then an OOM raised from the hostile frame."""
    frames = [{"filename": f"/home/u/{LINK}", "line": 12, "name": SCRIPT},
              {"filename": "/home/u/train.py", "line": 30, "name": "main"}]
    base, segment = 0x7F0000000000, 20 << 20
    sizes = [4 << 20, 2 << 20, 1 << 20, 3 << 20]
    trace = [{"action": "segment_alloc", "addr": base, "size": segment, "stream": 0, "time_us": 1, "frames": frames}]
    for i, size in enumerate(sizes):
        trace.append({"action": "alloc", "addr": base + sum(sizes[:i]), "size": size, "stream": 0, "time_us": 2 + i,
                      "frames": frames})
    for i, size in enumerate(sizes[:2]):
        for action in ("free_requested", "free_completed"):
            trace.append({"action": action, "addr": base + sum(sizes[:i]), "size": size, "stream": 0,
                          "time_us": 6 + i, "frames": frames})
    trace.append({"action": "oom", "addr": 0, "size": 64 << 20, "stream": 0, "time_us": 8, "frames": frames,
                  "device_free": 1 << 20})
    live = base + sizes[0] + sizes[1]
    blocks = [{"address": base, "size": live - base, "requested_size": 0, "state": "inactive", "frames": []},
              {"address": live, "size": sizes[2], "requested_size": sizes[2], "state": "active_allocated",
               "frames": frames},
              {"address": live + sizes[2], "size": sizes[3], "requested_size": sizes[3], "state": "active_allocated",
               "frames": frames},
              {"address": base + sum(sizes), "size": segment - sum(sizes), "requested_size": 0, "state": "inactive",
               "frames": []}]
    tag = f"module::forward::{IMG}"
    return {
        "segments": [{"device": 0, "address": base, "total_size": segment, "allocated_size": sizes[2] + sizes[3],
                      "active_size": sizes[2] + sizes[3], "requested_size": sizes[2] + sizes[3], "stream": 0,
                      "segment_type": "large", "segment_pool_id": (0, 0), "is_expandable": False, "frames": frames,
                      "blocks": blocks}],
        "device_traces": [trace],
        "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": f"expandable_segments:False,{IMG}",
                               "expandable_segments": False},
        "external_annotations": [{"device": 0, "name": tag, "stage": "START", "time_us": 1},
                                 {"device": 0, "name": tag, "stage": "END", "time_us": 9}],
    }


@pytest.fixture
def hostile(tmp_path: Path) -> Analysis:
    path = tmp_path / "hostile.pickle"
    path.write_bytes(pickle.dumps(hostile_snapshot(), protocol=4))
    return analyzer.analyze(path)


def realistic(a: Analysis) -> Analysis:
    """Findings, remedies, verdict, fragmentation and theory in the shapes the diagnosis produces, deliberately
    out of order, on the first device."""
    d = a.devices[0]
    t0 = a.trace.time_origin_us
    verdict = "Out of memory in the forward pass of step 1 (layers.4.attn): activations are 85% of the peak."
    findings: list[Finding[Details]] = [
        KVCacheFinding(severity="info", bytes=512 << 20, summary="512 MiB kept across the forward",
                       evidence=Evidence(event_index=[380, 380],
                                         details=KVCacheDetails(share=0.02, tensors=48, layers=24, quantized=False))),
        OomFinding(severity="critical", bytes=2 << 30, summary="2 GiB asked, 1.8 GiB free", verdict="capacity",
                   phase="forward", module="layers.0.attn", step=1,
                   evidence=Evidence(time_us=[t0 + 2000, t0 + 4000], event_index=[200, 418],
                                     allocations=[{"bytes": 2 << 30, "top_user_frame": "gpt.py:39 forward",
                                                   "module": "layers.0.attn", "category": "activation",
                                                   "phase": "forward", "op": None}],
                                     details=OomDetails(requested_bytes=2 << 30, device_free_bytes=None,
                                                        reserved_bytes=22 << 30, allocated_bytes=21 << 30,
                                                        reserved_unallocated_bytes=1 << 30,
                                                        largest_free_block_bytes=None, outside_pytorch_bytes=None,
                                                        capacity_bytes=None, capacity_source="reserved + free",
                                                        expandable_segments=None, oom_top_user_frame=None))),
    ]
    remedies = [
        {"id": "activation_checkpointing", "rank": 4, "title": "Activation checkpointing", "saved_bytes": 15 << 30,
         "new_peak_bytes": 7 << 30, "fits": True, "confidence": "medium", "try_first": False,
         "how": "x = checkpoint(block, x, use_reentrant=False)", "cost": "20-30% more compute", "purpose": "fix",
         "note": None, "saving_source": "formula", "replay": None, "plan_step": None},
        {"id": "micro_batch", "rank": 1, "title": "Halve the micro-batch", "saved_bytes": 11 << 30,
         "new_peak_bytes": 12 << 30, "fits": True, "confidence": "high", "try_first": True,
         "how": "batch_size //= 2", "cost": "instant", "purpose": "fix", "note": None, "saving_source": "formula",
         "replay": None, "plan_step": None},
    ]
    fragmentation = FragmentationPicture(
        event_index=380, reserved_bytes=22 << 30, allocated_bytes=21 << 30, inactive_bytes=1 << 30,
        internal_bytes=2 << 20, external_bytes=1 << 29, cached_free_segments_bytes=0,
        largest_free_block_bytes=256 << 20, request_bytes=512 << 20, expandable_segments=False, segments_recorded=True,
        segments=[FreeInSegment(2, 1 << 30, 1 << 30, 0, 0), FreeInSegment(1, 1 << 30, 1 << 29, 1 << 29, 256 << 20)])
    theory = Theory(parameter_bytes=800 << 20, gradient_bytes=0, optimizer_state_bytes=0, activation_bytes=5 << 30,
                    notes=["no optimizer state was seen"], regime="mixed-precision Adam",
                    regimes=[RegimeCheck("fp32 Adam", 200e6, 3 << 30, 800 << 20, False)])
    diagnosis = replace(d.diagnosis, verdict=verdict, findings=findings, remedies=remedies,
                        fragmentation=fragmentation, theory=theory)
    return with_diagnosis(a, diagnosis)


def with_diagnosis(a: Analysis, diagnosis: Diagnosis) -> Analysis:
    """The analysis with its first device diagnosed as given."""
    return replace(a, devices=[replace(a.devices[0], diagnosis=diagnosis), *a.devices[1:]])


# --- content, on the view-model ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["capacity_oom", "fragmentation", "gpt_activation_peak", "checkpoint_gather"])
def test_breakdowns_tree_and_chart_agree_with_the_peak(name: str) -> None:
    view = build_view(analysis(SIM / f"{name}.pickle"))
    for d in view.devices:
        peak = d.peak_allocated_bytes
        for rows in (d.by_category, d.by_phase, d.by_module):
            assert sum(r.bytes for r in rows) == peak
        assert sum(n.bytes for n in d.modules) == peak

        def check(node):  # every node is the sum of its children
            if node.children:
                assert sum(c.bytes for c in node.children) == node.bytes, node.path
                for c in node.children:
                    check(c)
        for n in d.modules:
            check(n)
        points = d.chart.points
        assert len(points) <= CHART_POINTS[1] + 3
        at_peak = points[points["seq"] == d.chart.peak_seq]
        assert int(at_peak["allocated_bytes"].iloc[0]) == peak == int(points["allocated_bytes"].max())
        stacked = points[[column for _, column, _ in d.chart.categories]].sum(axis=1)
        assert (stacked == points["allocated_bytes"]).all()
        starts = [b.start for b in d.chart.bands]
        assert starts == sorted(starts) and all(b.start < b.end for b in d.chart.bands)
        assert len(d.live) == min(LIVE_SHOWN, d.live_count)
        assert d.live_left_out[1] + sum(a.allocated_bytes for a in d.live) == peak
        assert all(len(a.frames) <= FRAMES_SHOWN for a in d.live)


def test_phase_bands_follow_the_steps() -> None:
    d = build_view(analysis(SIM / "gpt_activation_peak.pickle")).devices[0]
    phases = [b.phase for b in d.chart.bands]
    assert phases[0] == "load" and phases.count("forward") == 3 and phases.count("optimizer") == 3


def test_module_tree_nests_by_fqn_and_folds_the_tail() -> None:
    import pandas as pd

    live = pd.DataFrame({
        "module": ["layers.0.attn", "layers.0.attn.qkv", "layers.0.mlp", "layers.1.attn", "head", "tiny", "tinier",
                   "/very/long/path/to/train.py:12 forward", "a.b.c"],
        "allocated_bytes": [300, 100, 200, 400, 500, 2, 1, 50, 47],
    })
    roots = {n.path: n for n in module_tree(live, min_share=0.01)}
    assert list(roots) == ["layers", "head", "/very/long/path/to/train.py:12 forward", "a.b.c", ""]
    assert sum(n.bytes for n in roots.values()) == 1600
    assert roots[""].label == "other (2 modules)" and roots[""].bytes == 3  # under 1% each: folded together
    layers = roots["layers"]
    assert layers.bytes == 1000 and [c.label for c in layers.children] == ["0", "1.attn"]  # a lone chain reads as one
    attn = next(c for c in layers.children[0].children if c.label == "attn")
    assert {c.label: c.bytes for c in attn.children} == {OWN: 300, "qkv": 100}
    assert roots["/very/long/path/to/train.py:12 forward"].label == "…/path/to/train.py:12 forward"


def test_verdict_is_the_diagnosed_one() -> None:
    a = realistic(analysis(SIM / "capacity_oom.pickle"))
    assert build_view(a).verdict == a.devices[0].diagnosis.verdict


def test_the_verdict_of_several_devices_is_about_the_one_that_ran_out(real_dir: Path) -> None:
    view = build_view(analysis(real_dir / "constructor-sun-code_location" / "memory_snapshot.pickle"))
    assert [d.name for d in view.devices] == ["cuda:1", "cuda:2", "cuda:0"]  # the OOM first, then by peak
    assert view.lead_device == 1 and "cuda:1" in view.verdict
    assert view.devices[0].oom is not None and view.devices[0].oom.where.endswith("update_nodes")
    assert view.comparison is not None and view.comparison.summary.startswith("cuda:1 peaks at 78.29 GiB, 3.9x")
    assert view.verdict.endswith("cuda:1 peaks at 3.9x the median device (cuda:2): an imbalance, see below.")


def test_findings_and_remedies_are_ordered_and_their_evidence_reads_well() -> None:
    d = build_view(realistic(analysis(SIM / "capacity_oom.pickle"))).devices[0]
    assert [f.kind for f in d.findings] == ["oom", "kv_cache"]  # critical first
    oom = d.findings[0]
    assert oom.when == "0.002 s – 0.004 s" and oom.events == "200 – 418"
    said = {x.name: x.text for x in oom.details}
    assert (said["requested bytes"], said["capacity source"], said["device free bytes"]) == \
        ("2.00 GiB", "reserved + free", "unknown")
    assert oom.allocations[0].where == "gpt.py:39 forward"
    assert {x.name: x.text for x in d.findings[1].details}["share"] == "2%"
    assert [r.rank for r in d.remedies] == [1, 4] and d.remedies[0].try_first
    assert d.remedies[1].how == "x = checkpoint(block, x, use_reentrant=False)"


def test_fragmentation_and_theory_views() -> None:
    a = realistic(analysis(SIM / "capacity_oom.pickle"))
    d = build_view(a).devices[0]
    fr = d.fragmentation
    assert fr.where == "at the out-of-memory" and fr.request_blocked  # 512 MiB > largest 256 MiB, < 1 GiB free
    assert [s["free_bytes"] for s in fr.segments] == [1 << 29, 0] and fr.segments[0]["used_share"] == 0.5
    assert [(x.name, x.text) for x in fr.other] == [("internal bytes", "2.00 MiB"), ("external bytes", "512.00 MiB"),
                                                    ("cached free segments bytes", "0 B"), ("segments recorded", "yes")]
    rows = {r.name: r.measured_bytes for r in d.theory.rows}
    assert rows == {"parameter": 800 << 20, "gradient": 0, "optimizer state": 0, "activation": 5 << 30}
    assert [(x.name, x.text) for x in d.theory.facts] == [("regime", "mixed-precision Adam")]
    assert d.theory.tables[0].rows == [["fp32 Adam", "200,000,000", "3.00 GiB", "800.00 MiB", "no"]]
    assert d.theory.notes == ["no optimizer state was seen"]
    a = with_diagnosis(a, replace(a.devices[0].diagnosis, fragmentation=None))
    end = build_view(a).devices[0].fragmentation
    assert end.where == "at the end of the recording" and end.reserved_bytes == a.devices[0].end["reserved_bytes"]


def test_terminal_summary_leads_with_the_verdict() -> None:
    a = realistic(analysis(SIM / "capacity_oom.pickle"))
    console = Console(record=True, width=140, force_terminal=False)
    print_summary(a, console)
    text = console.export_text()
    assert text.startswith(a.devices[0].diagnosis.verdict[:60])
    for expected in ("category", "phase", "top modules", "critical", "Halve the micro-batch",
                     "Activation checkpointing", human_bytes(a.devices[0].peak.allocated_bytes)):
        assert expected in text
    remedies = text[text.index(build_view(a).devices[0].remedies_heading):]   # the list, after any plan
    assert remedies.index("Halve the micro-batch") < remedies.index("Activation checkpointing")
    quiet = Console(record=True, quiet=True)
    print_summary(a, quiet)
    assert quiet.export_text() == ""


def test_cli_quiet_prints_nothing_and_writes_md_and_pdf(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    source = SIM / "capacity_oom.pickle"
    assert main([str(source), "--format", "md", "-o", str(tmp_path / "r.md"), "-q"]) == 0
    assert capsys.readouterr().out == ""
    assert (tmp_path / "r.md").exists() and (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --- HTML in a real browser -------------------------------------------------------------------------------------

SECTIONS = ("timeline", "breakdown", "findings", "remedies", "live", "fragmentation", "theory")


@pytest.fixture(scope="module")
def browser():
    binary = chromium_binary()
    if binary is None:
        pytest.skip("chromium is not installed (apt-get install chromium); CI installs it in .ci/run")
    with Chromium(binary) as b:
        yield b


def _open(browser: Chromium, a: Analysis, folder: Path, name: str) -> str:
    page = folder / f"{name}.html"
    write_html(a, page)
    assert page.stat().st_size < MAX_HTML_BYTES
    record = browser.open(page.as_uri())
    assert record.errors() == []
    assert record.requests == [page.as_uri()], "the report must request nothing but itself"
    browser.screenshot(folder / f"{name}.png")
    assert (folder / f"{name}.png").stat().st_size > 10_000
    return page.as_uri()


@pytest.mark.parametrize("name", ["capacity_oom", "fragmentation", "checkpoint_gather"])
def test_html_opens_cleanly_with_every_section(browser: Chromium, tmp_path: Path, name: str) -> None:
    a = analysis(SIM / f"{name}.pickle")
    _open(browser, a, tmp_path, name)
    ids = set(browser.evaluate("[...document.querySelectorAll('[id]')].map(e => e.id)"))
    expected = {"verdict", "summary", "input"} | {f"{s}-{d.device}" for s in SECTIONS for d in a.devices}
    assert expected <= ids
    verdict = browser.evaluate("document.getElementById('verdict').innerText")
    assert verdict.strip() == build_view(a).verdict
    assert browser.evaluate("document.querySelectorAll('#timeline-0 svg').length") == 1


def test_html_of_a_three_gpu_oom_and_of_a_profiler_trace(browser: Chromium, tmp_path: Path, real_dir: Path) -> None:
    a = analysis(real_dir / "constructor-sun-code_location" / "memory_snapshot.pickle")
    _open(browser, a, tmp_path, "real")
    assert browser.evaluate("document.querySelectorAll('.chart svg').length") == 3
    _open(browser, analysis(FIXTURES / "kineto" / "train.pt.trace.json.gz"), tmp_path, "kineto")
    browser.open((tmp_path / "real.html").as_uri(), dark=True)
    browser.screenshot(tmp_path / "real-dark.png", full_page=False)


def test_hostile_strings_are_text_in_html(browser: Chromium, tmp_path: Path, hostile: Analysis) -> None:
    hostile = realistic(hostile)
    hostile.devices[0].diagnosis.remedies[0]["how"] = f"print('{SCRIPT}')"
    _open(browser, hostile, tmp_path, "hostile")  # no dialog, no error, no request
    assert browser.evaluate("document.querySelectorAll('img').length") == 0
    assert browser.evaluate("document.scripts.length") == 2  # the data block and ours, allowed by its hash
    assert browser.evaluate("document.querySelectorAll('a[href]:not([href^=\"#\"])').length") == 0
    text = browser.evaluate("document.body.innerText")
    for raw in (SCRIPT, LINK, IMG):
        assert raw in text
    html = (tmp_path / "hostile.html").read_text()
    assert SCRIPT not in html and IMG not in html


# --- PDF --------------------------------------------------------------------------------------------------------

def _pdf_text(pdf: Path) -> str:
    if shutil.which("pdftotext") is None:
        pytest.skip("pdftotext is not installed (apt-get install poppler-utils); CI installs it in .ci/run")
    return subprocess.run(["pdftotext", "-layout", str(pdf), "-"], capture_output=True, text=True, check=True).stdout


def _pages(pdf: Path) -> int:
    info = subprocess.run(["pdfinfo", str(pdf)], capture_output=True, text=True, check=True).stdout
    return int(re.search(r"^Pages:\s+(\d+)", info, re.M).group(1))


def test_pdf_has_the_numbers_on_few_pages_with_vector_charts(tmp_path: Path) -> None:
    pytest.importorskip("weasyprint", reason="weasyprint is the optional extra `pdf`")
    pdf = tmp_path / "report.pdf"
    assert main([str(SIM / "capacity_oom.pickle"), "--format", "pdf", "-o", str(pdf), "-q"]) == 0
    text = " ".join(_pdf_text(pdf).split())
    d = build_view(analysis(SIM / "capacity_oom.pickle")).devices[0]
    for expected in (human_bytes(d.peak_allocated_bytes), human_bytes(d.oom.requested_bytes),
                     "What the peak is made of", "Fragmentation at the out-of-memory", "Theory against measurement",
                     d.by_category[0].label, human_bytes(d.by_category[0].bytes)):
        assert expected in text
    assert 2 <= _pages(pdf) <= 20
    images = subprocess.run(["pdfimages", "-list", str(pdf)], capture_output=True, text=True, check=True).stdout
    assert len(images.strip().splitlines()) == 2, "charts must be vectors, not images"


def test_hostile_strings_are_text_in_pdf(tmp_path: Path, hostile: Analysis) -> None:
    pytest.importorskip("weasyprint", reason="weasyprint is the optional extra `pdf`")
    from analyzer.report.pdf import write_pdf

    pdf = tmp_path / "hostile.pdf"
    write_pdf(hostile, pdf)
    text = "".join(_pdf_text(pdf).split())
    for raw in (SCRIPT, LINK, IMG):
        assert "".join(raw.split()) in text


# --- Markdown ---------------------------------------------------------------------------------------------------

def _github_html(markdown: str) -> str:
    cmarkgfm = pytest.importorskip("cmarkgfm", reason="cmarkgfm (GitHub's renderer) is in the `test` extra")
    from cmarkgfm.cmark import Options

    return cmarkgfm.github_flavored_markdown_to_html(markdown, options=Options.CMARK_OPT_UNSAFE)


def test_markdown_summary_numbers_and_chart(tmp_path: Path) -> None:
    a = realistic(analysis(SIM / "capacity_oom.pickle"))
    out = tmp_path / "issue.md"
    assert write_markdown(a, out) == [out, tmp_path / "issue.png"]
    md = out.read_text()
    d = build_view(a).devices[0]
    assert md.index("**Verdict:**") < md.index("```mermaid\nxychart-beta") < md.index("| at the peak |")
    for r in d.by_category:
        assert f"| {md_text(r.label)} | {human_bytes(r.bytes)} | {r.share:.0%} |" in md
    assert f"1. **Halve the micro-batch**: saves 11.00 GiB; peak {human_bytes(d.demand_bytes)} → 12.00 GiB; fits" in md
    assert "batch_size //= 2" in md
    assert "- **critical** oom (2.00 GiB): 2 GiB asked, 1.8 GiB free" in md
    html = _github_html(md)
    plans = sum(1 for device in a.devices if device.diagnosis.plan and (len(device.diagnosis.plan["steps"]) > 1
                                                                         or not device.diagnosis.plan["fits"]))
    # a plan of several changes is a table of its steps; a plan of one is the remedy marked try first
    assert html.count("<table>") == 1 + plans and "<img" not in html   # issue 33.6: nothing a paste loses
    line = re.search(r"^    line \[(.*)\]$", md, re.MULTILINE).group(1).split(", ")
    assert max(float(v) for v in line) == round(a.devices[0].peak.allocated_bytes / 2**30, 2)   # the peak shows
    assert "<a " not in html
    assert len(md) < 7000


def test_markdown_of_three_devices_says_each_remedy_once() -> None:
    """Issue 33.6: constructor-sun's three GPUs list the same remedies; the Markdown says each once, with what it
    does on each device, and the overview table once."""
    if not REAL.is_dir():
        pytest.skip(f"real recordings not found at {REAL}")
    view = build_view(analysis(REAL / "constructor-sun-code_location" / "memory_snapshot.pickle"))
    md = render_markdown(view, None)
    titles = {r.title for d in view.in_full() for r in d.remedies[:3]}
    assert len(view.in_full()) == 3 and titles
    assert all(md.count(f"**{md_text(t)}**") == 1 for t in titles)
    assert md.count("| device | peak |") == 1 and md.count("```mermaid") == 3
    assert md.count("\n   cuda\\:1: saves 43.62 GiB; peak 83.23 GiB → 39.62 GiB; fits; confidence low; **try first**") == 1
    assert md.count("\n   cuda\\:1: saves 41.50 GiB; peak 83.23 GiB → 41.74 GiB; fits; confidence high\\\n") == 1
    assert md.count("\n   cuda\\:0: saves 2.70 GiB; peak 7.88 GiB → 5.17 GiB; confidence high; **try first**") == 1
    assert md.count(md_text(view.devices[0].verdict)) == 1   # the lead verdict, said once at the top


def test_markdown_escaping_on_github() -> None:
    for raw in (SCRIPT, LINK, IMG, "a|b`c`", "x@y.com #12 www.evil.com $x$ ~~s~~ *e* _u_ &lt; http://e"):
        for html in (_github_html(md_text(raw)), _github_html(f"| h |\n|---|\n| {md_code(raw, in_table=True)} |")):
            assert "<a " not in html and "<img" not in html and "<script" not in html
            assert "<em>" not in html and "<del>" not in html
    assert "a|b`c`" in _github_html(f"| h |\n|---|\n| {md_code('a|b`c`', in_table=True)} |").replace("<code>", "")


def test_hostile_strings_are_text_in_markdown(tmp_path: Path, hostile: Analysis) -> None:
    md = render_markdown(build_view(hostile), "chart.png")
    html = _github_html(md)
    assert "<script" not in html and "<a " not in html
    assert "<img" not in html
    titles = re.findall(r'^    title "(.*)"$', md, re.MULTILINE)
    assert titles and all(re.fullmatch(r"[A-Za-z0-9 :._()-]*", t) for t in titles)   # nothing of the input's markup
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html and "](http://evil)" in html
    assert "&lt;img src=x onerror=alert(1)&gt;" in html


def test_html_stays_small_on_a_large_input(tmp_path: Path) -> None:
    """Many devices, long histories and deep stacks: the page is bounded by what the view keeps, not the input."""
    deep = [{"filename": f"/site-packages/lib{i}.py", "line": i, "name": f"f{i}"} for i in range(120)]
    stacks = [[{"filename": f"/home/u/m{k}.py", "line": k, "name": "forward"}, *deep] for k in range(300)]
    base, traces, segments = 0x7F0000000000, [], []
    for device in range(4):
        entries = [{"action": "segment_alloc", "addr": base, "size": 1 << 30, "stream": 0, "time_us": 0,
                    "frames": deep}]
        for i in range(6000):  # a sawtooth of 512 KiB tensors from 300 places
            entries.append({"action": "alloc", "addr": base + (i % 1000) * (1 << 19), "size": 1 << 19, "stream": 0,
                            "time_us": 1 + 2 * i, "frames": stacks[i % 300]})
            if i % 1000 == 999:
                entries += [{"action": "free_completed", "addr": base + j * (1 << 19), "size": 1 << 19, "stream": 0,
                             "time_us": 2 + 2 * i, "frames": deep} for j in range(1000)]
        traces.append(entries)
        segments.append({"device": device, "address": base, "total_size": 1 << 30, "allocated_size": 0,
                         "active_size": 0, "requested_size": 0, "stream": 0, "segment_type": "large",
                         "segment_pool_id": (0, 0), "is_expandable": False, "frames": [],
                         "blocks": [{"address": base, "size": 1 << 30, "requested_size": 0, "state": "inactive",
                                     "frames": []}]})
    path = tmp_path / "large.pickle"
    path.write_bytes(pickle.dumps({"segments": segments, "device_traces": traces}, protocol=4))
    html = render_html(analyzer.analyze(path))
    # the explorer embeds these 24,000 allocations (under interactive.ALLOCATIONS_EMBEDDED) and 3,000 points per
    # device; stacks are interned and cut to their Python frames (at most 40)
    assert len(html.encode()) < MAX_HTML_BYTES / 2
