"""`--format md`: a short summary to paste into a GitHub issue, whole on its own once pasted (the chart is a
Mermaid block GitHub draws inline; a PNG of it is written beside the file for other viewers).

What it says: the verdict, per device the peak split by category (table) with its phases and largest modules
and its memory over time, the three cheapest remedies with their code (with several devices, each remedy once
with the devices it applies to), and one line per finding. The HTML report is for digging.

Every string from the input file goes through `md_text` or `md_code`, so a function named `<script>` or a
file named `](http://evil)` reads as itself: no markup, no link, no image, no mention, and a bidi override or
an ESC shows as `\u202e` / `\x1b` (`visible`).
"""
from __future__ import annotations

import re
from pathlib import Path

from analyzer.core.units import binary_unit, human_bytes
from analyzer.report.job_report import Report, report_view
from analyzer.report.md_escape import code_block, md_code, md_text
from analyzer.report.page import reserved, words
from analyzer.report.plots import memory_figure, save_png
from analyzer.report.view import DeviceView, RemedyView, ReportView, Share

TOP_REMEDIES = 3
TOP_MODULES = 5
def _shares_line(rows: list[Share]) -> str:
    return ", ".join(f"{md_text(r.label)} {human_bytes(r.bytes)} ({r.share:.0%})" for r in rows)


def _facts(r: RemedyView, demand: int) -> list[str]:
    facts = []
    if r.saved_bytes is not None:
        facts.append(f"saves {human_bytes(r.saved_bytes)}")
    if r.new_peak_bytes is not None:
        facts.append(f"peak {human_bytes(demand)} → {human_bytes(r.new_peak_bytes)}")
    if r.fits is not None:
        facts.append("fits" if r.fits else "still does not fit")
    if r.confidence:
        facts.append(f"confidence {md_text(r.confidence)}")
    if r.try_first:
        facts.append("**try first**" + (f" ({md_text(r.plan_step)})" if r.plan_step else ""))
    return facts


def _remedy(r: RemedyView, demand: int, number: int) -> list[str]:
    facts = _facts(r, demand)
    lines = [f"{number}. **{md_text(r.title)}**" + (f": {'; '.join(facts)}" if facts else "")]
    return lines + _cost_and_code(r, lines)


def _cost_and_code(r: RemedyView, lines: list[str]) -> list[str]:
    """What a remedy costs and its code, under its line (ending that line with a hard break)."""
    more = []
    if r.cost:
        lines[-1] += "\\"   # a hard line break before the cost
        more.append(f"   Cost: {md_text(r.cost)}.")
    if r.how:
        more.extend(code_block(r.how, "   "))
    return more


def _remedies_once(devices: list[DeviceView]) -> list[str]:
    """Each remedy of the devices shown once, in the order the devices first list them, with what it does on
    each device it applies to (the same three remedies under three devices read as nine)."""
    by_id: dict[str, list[tuple[DeviceView, RemedyView]]] = {}
    for d in devices:
        for r in d.remedies[:TOP_REMEDIES]:
            by_id.setdefault(r.id, []).append((d, r))
    lines = ["**What to change, cheapest first** (each once, with the devices it applies to):", ""]
    for number, pairs in enumerate(by_id.values(), 1):
        first = pairs[0][1]
        lines.append(f"{number}. **{md_text(first.title)}**")
        for d, r in pairs:
            facts = _facts(r, d.demand_bytes)
            lines[-1] += "\\"
            lines.append(f"   {md_text(d.name)}" + (f": {'; '.join(facts)}" if facts else ""))
        lines += _cost_and_code(first, lines)
    return lines + [""]


#: points of the Markdown chart: each the highest allocated bytes of its span of events, so the peak shows
MERMAID_POINTS = 60
_MERMAID_SAFE = re.compile(r"[^A-Za-z0-9 :._()-]")


def mermaid_chart(d: DeviceView) -> list[str]:
    """Allocated bytes over the allocator's events as a Mermaid `xychart-beta` block, which GitHub draws inline
    wherever the Markdown is pasted (an image beside the file shows nothing there); with the device's memory as a
    flat second line when it is known. Empty without a chart."""
    chart = d.chart
    if chart is None or chart.points.empty:
        return []
    points = chart.points[chart.points["seq"] >= 0] if (chart.points["seq"] >= 0).any() else chart.points
    seq = points["seq"].to_numpy()
    allocated = points["allocated_bytes"].to_numpy()
    first, last = int(seq[0]), int(seq[-1])
    span = max(last - first + 1, 1)
    count = min(MERMAID_POINTS, span)
    bins = ((seq - first) * count // span).clip(0, count - 1)
    highest: list[int] = []
    for b in range(count):   # a span without a drawn point holds what the one before held
        inside = allocated[bins == b]
        highest.append(int(inside.max()) if len(inside) else highest[-1] if highest else int(allocated[0]))
    top = max(chart.peak_bytes, chart.capacity_bytes or 0, 1)
    scale, unit = binary_unit(top)
    name = _MERMAID_SAFE.sub("", d.name)[:60]
    lines = ["```mermaid", "xychart-beta",
             f'    title "{name}: allocated memory over the allocator events ({unit})"',
             f'    x-axis "allocator event" {first} --> {last}',
             f'    y-axis "{unit}" 0 --> {_round_up(top / scale)}',
             "    line [" + ", ".join(f"{v / scale:.2f}" for v in highest) + "]"]
    if chart.capacity_bytes:
        lines.append("    line [" + ", ".join([f"{chart.capacity_bytes / scale:.2f}"] * count) + "]")
    said = (f"Peak {human_bytes(chart.peak_bytes)} at event {chart.peak_seq}"
            + (f", out of memory at event {chart.oom_seq}" if chart.oom_seq is not None else "")
            + (f"; the flat line is the device's {human_bytes(chart.capacity_bytes)}" if chart.capacity_bytes else "")
            + f". Each point is the highest of its span of events ({MERMAID_POINTS} spans).")
    return lines + ["```", "", said, ""]


def _round_up(value: float) -> str:
    """An axis top a little above `value`, at a round number."""
    step = 10 ** max(len(str(int(value))) - 1, 0) / 2 if value >= 1 else 0.1
    return f"{(int(value / step) + 1) * step:g}"


def _plan(d: DeviceView) -> list[str]:
    """The plan as a table: one change a row, the peak predicted after it, and the alternatives under it."""
    assert d.plan is not None
    if not d.plan.fits:
        return ["**Plan:** no combination of the offered remedies fits.", ""]
    if len(d.plan.steps) < 2:   # one change: the remedy marked try first, its alternatives the remedies listed
        return []
    lines = ["**Plan** (one change at a time, cheapest first; stop at the first that fits):", "",
             "| step | change | peak allocated | peak reserved | fits | from |", "|--:|---|--:|--:|---|---|"]
    lines += [f"| {i} | {md_text(s.title)} | {human_bytes(s.peak_allocated_bytes)} | "
              f"{'' if s.peak_reserved_bytes is None else human_bytes(s.peak_reserved_bytes)} | "
              f"{'yes' if s.fits else 'not yet'} | {s.source} |" for i, s in enumerate(d.plan.steps, 1)]
    lines.append("")
    lines += [f"- or {md_text(changes)}: peak {human_bytes(peak)} ({md_text(cost)})"
              for changes, peak, cost in d.plan.alternatives]
    return lines + ([""] if d.plan.alternatives else [])


def _device(d: DeviceView, several: bool, said: str) -> list[str]:
    title = f"### {md_text(d.name)}: peak {human_bytes(d.peak_allocated_bytes)} allocated, " \
            f"{reserved(d.reserved_peak_bytes)}"
    lines = [title, ""] + mermaid_chart(d)
    if several and d.verdict not in said:
        lines += [md_text(d.verdict), ""]
    if d.oom:
        where = f" at {md_code(d.oom.where)}" if d.oom.where else ""
        lines += [f"**Out of memory**{where}: asked for {human_bytes(d.oom.requested_bytes)} with "
                  f"{human_bytes(d.oom.device_free_bytes)} free on the device.", ""]
    if d.by_category:
        lines += ["| at the peak | bytes | share |", "|---|--:|--:|"]
        lines += [f"| {md_text(r.label)} | {human_bytes(r.bytes)} | {r.share:.0%} |"
                  for r in d.by_category]
        lines += ["", f"**Phases:** {_shares_line(d.by_phase)}", ""]
        modules = ", ".join(f"{md_code(r.label)} {human_bytes(r.bytes)} ({r.share:.0%})"
                            for r in d.by_module[:TOP_MODULES])
        lines += [f"**Largest modules:** {modules}", ""]
    if d.plan is not None:
        lines += _plan(d)
    if d.remedies and not several:
        lines += ["**Try first, cheapest first:**", ""]
        for i, r in enumerate(d.remedies[:TOP_REMEDIES], 1):
            lines += _remedy(r, d.demand_bytes, i)
        lines.append("")
    if d.findings:
        lines += ["**Findings:**", ""]
        lines += [f"- **{md_text(f.severity)}** {md_text(words(f.kind))}"
                  + (f" ({human_bytes(f.bytes)})" if f.bytes is not None else "") + f": {md_text(f.summary)}"
                  for f in d.findings]
        lines.append("")
    return lines


def _overview(devices: list[DeviceView]) -> list[str]:
    """One row per device, the worst first: its peak, when, whether it ran out, what the peak is made of."""
    lines = ["| device | peak | the peak is | out of memory |", "| --- | ---: | --- | --- |"]
    lines += [f"| {md_text(d.name)} | {human_bytes(d.peak_allocated_bytes)} | {md_text(d.headline or '—')} | "
              f"{human_bytes(d.oom.requested_bytes) + ' requested' if d.oom else 'no'} |" for d in devices]
    return lines + [""]


def _recordings(view: ReportView) -> list[str]:
    """Separate recordings analysed together: one row each, its fullest GPU's peak and its verdict."""
    assert view.recordings is not None
    lines = ["| recording | peak | verdict |", "| --- | ---: | --- |"]
    lines += [f"| {md_code(r.label, in_table=True)} | "
              f"{'no GPU memory' if r.peak_bytes is None else f'{human_bytes(r.peak_bytes)} {md_text(r.device)}'} | "
              f"{md_text(r.verdict)} |" for r in view.recordings]
    return lines + [""]


def render_markdown(view: ReportView, chart_name: str | None) -> str:
    """The summary; `chart_name` is the PNG's path relative to the Markdown file (None: no chart)."""
    lines = [f"## GPU memory report: {md_code(Path(view.input.path).name)}", "",
             f"**Verdict:** {md_text(view.verdict)}", ""]
    if view.comparison is not None:
        lines += [f"**Imbalance:** {md_text(view.comparison.summary)}", ""]
        lines += [f"- {md_text(r)}" for r in view.comparison.remedies] + [""]
    if view.recordings is not None:
        lines += _recordings(view)
    several = len(view.devices) > 1
    if several:
        lines += _overview(view.devices)
    for d in view.in_full():
        lines += _device(d, several, view.verdict)
    if several and any(d.remedies for d in view.in_full()):
        lines += _remedies_once(view.in_full())
    if view.warnings:
        lines += ["**Warnings:**", ""] + [f"- {md_text(w)}" for w in view.warnings] + [""]
    beside = f" and {md_code(chart_name)} the charts in full" if chart_name else ""
    lines.append(f"<sub>analyzer {view.version}; input {md_code(view.input.path)} ({md_text(view.input.torch_era)}); "
                 f"the HTML report (`analyze FILE --format html`) has the stacks, fragmentation and theory{beside}.</sub>")
    return "\n".join(lines) + "\n"


def write_markdown(report: Report, out: Path) -> list[Path]:
    view = report_view(report)
    charts = [d.chart for d in view.in_full() if d.chart is not None]
    png = out.with_suffix(".png")
    if charts:
        save_png(memory_figure(charts), png)
    out.write_text(render_markdown(view, png.name if charts else None), encoding="utf-8")
    return [out, png] if charts else [out]
