"""The JSON and the terminal say the same thing, field by field, on every real recording (issue 33.7: the JSON's
end state of hta/df_index_resolver read 0 allocated while the terminal said 3.82 GiB, the trace's last total).

Both are made from one Analysis; each field the terminal shows is looked for, formatted from the JSON's number,
on the device's own lines of the terminal summary.
"""
from __future__ import annotations

import io

import pytest
from rich.console import Console

import analyzer
from analyzer.core.units import human_bytes
from analyzer.errors import AnalyzerError
from analyzer.report.page import reserved
from analyzer.report.text import TOP_REMEDIES, print_summary
from analyzer.result import Analysis
from tests.support.paths import REAL

FILES = sorted(p for p in REAL.rglob("*") if p.is_file() and p.suffix in (".pickle", ".pkl", ".gz", ".json", ".sqlite")
               and p.name != "truth.json") if REAL.is_dir() else []


def _terminal(analysis: Analysis) -> str:
    out = io.StringIO()
    print_summary(analysis, Console(file=out, width=10_000, color_system=None, highlight=False))
    return out.getvalue()


def _sections(text: str, names: list[str]) -> dict[str, str]:
    """Each device's lines of the summary: from its header (`cuda:1  peak ...`) to the next device's."""
    lines = text.splitlines()
    starts = {name: next(i for i, line in enumerate(lines) if line.startswith(f"{name}  peak ")) for name in names}
    ends = sorted(starts.values()) + [len(lines)]
    return {name: "\n".join(lines[i:ends[ends.index(i) + 1]]) for name, i in starts.items()}


@pytest.mark.skipif(not FILES, reason=f"real recordings not found at {REAL}")
@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(REAL)))
def test_json_and_terminal_agree(path) -> None:
    try:
        analysis = analyzer.analyze(path)
    except AnalyzerError as error:
        pytest.skip(f"not analysed: {error}")
    if not isinstance(analysis, Analysis):
        pytest.skip("a set of ranks: its report is the job's")
    document = analysis.to_json()
    text = _terminal(analysis)
    names = [analysis.trace.device_label(d["device"]) for d in document["devices"]]
    sections = _sections(text, names)
    for name, d in zip(names, document["devices"], strict=True):
        shown, peak, end = sections[name], d["peak"], d["end"]
        assert (f"peak {human_bytes(peak['allocated_bytes'])} allocated ({human_bytes(peak['requested_bytes'])} "
                f"requested, {reserved(peak['reserved_bytes'] if d['reserved_recorded'] else None)})") in shown, name
        n, at = d["trace_entries"], peak["event_index"]
        when = ("in the end state (no history recorded)" if n == 0 else "before the only recorded event" if at < 0
                and n == 1 else f"before the first of {n} recorded events" if at < 0 else f"event {at} of {n}")
        assert when in shown, name
        assert f"end: {human_bytes(end['allocated_bytes'])} allocated, {reserved(end['reserved_bytes'])}" in shown, name
        free = end["largest_free_block_bytes"]
        assert f"largest free block {'not recorded' if free is None else human_bytes(free)}" in shown, name
        squashed = " ".join(shown.split())
        assert " ".join(d["verdict"].split()) in " ".join(text.split()), name
        for r in d["remedies"][:TOP_REMEDIES]:
            if r.get("saved_bytes") is not None and r.get("new_peak_bytes") is not None:
                assert f"saves {human_bytes(r['saved_bytes'])}, peak {human_bytes(r['new_peak_bytes'])}" in squashed
        for f in d["findings"]:
            assert " ".join(f["summary"].split()) in squashed, (name, f["kind"])
        if d["oom"] is not None:
            assert f"asked for {human_bytes(d['oom']['requested_bytes'])}" in shown, name
