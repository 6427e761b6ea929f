"""`--format md`: a short summary to paste into a GitHub issue, and the chart as a PNG beside it.

What it says: the verdict, per device the peak split by category (table) with its phases and largest modules,
the three cheapest remedies with their code, and one line per finding. The HTML report is for digging.

Every string from the input file goes through `md_text` or `md_code`, so a function named `<script>` or a
file named `](http://evil)` reads as itself: no markup, no link, no image, no mention, and a bidi override or
an ESC shows as `\u202e` / `\x1b` (`visible`).
"""
from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import quote

from analyzer.report.job_report import Report, report_view
from analyzer.report.plots import memory_figure, save_png
from analyzer.core.printable import visible
from analyzer.core.units import human_bytes
from analyzer.report.view import DeviceView, RemedyView, ReportView, Share, reserved, words

TOP_REMEDIES = 3
TOP_MODULES = 5
# inline constructs: escapes, code, emphasis, links and images, raw HTML and autolinks, entities, strikethrough,
# table cells, math, and a colon before a non-space (URL schemes `http:`, `mailto:`, and emoji codes)
_MARKUP = re.compile(r"([\\`*_\[\]<>!&~|$]|:(?=\S))")


def md_text(value: object) -> str:
    """Plain text on one line: Markdown punctuation backslash-escaped; `www.` broken so that GitHub does not
    make it a link; a zero-width space after `@` and `#`, and inside `GH-1`, so that no one is mentioned and no
    issue is linked."""
    text = _MARKUP.sub(r"\\\1", " ".join(visible(str(value)).split()))
    text = re.sub(r"(?i)\b(www)\.", r"\1\\.", text)
    text = re.sub(r"(?i)\b(gh)-(?=\d)", "\\1-\u200b", text)
    return text.replace("@", "@\u200b").replace("#", "#\u200b")


def md_code(value: object, in_table: bool = False) -> str:
    """An inline code span (nothing inside one is markup or a link); in a table cell `|` is escaped, the one
    character GitHub's table parser reads inside code."""
    text = " ".join(visible(str(value)).split())
    if in_table:
        text = text.replace("|", "\\|")
    fence = "`" * (max((len(run) for run in re.findall(r"`+", text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def _code_block(code: str, indent: str) -> list[str]:
    fence = "`" * max(3, max((len(run) for run in re.findall(r"`+", code)), default=0) + 1)
    return [f"{indent}{fence}", *(f"{indent}{line}" for line in code.splitlines()), f"{indent}{fence}"]


def _shares_line(rows: list[Share]) -> str:
    return ", ".join(f"{md_text(r.label)} {human_bytes(r.bytes)} ({r.share:.0%})" for r in rows)


def _remedy(r: RemedyView, demand: int, number: int) -> list[str]:
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
    lines = [f"{number}. **{md_text(r.title)}**" + (f": {'; '.join(facts)}" if facts else "")]
    if r.cost:
        lines[0] += "\\"   # a hard line break before the cost
        lines.append(f"   Cost: {md_text(r.cost)}.")
    if r.how:
        lines.extend(_code_block(r.how, "   "))
    return lines


def _plan(d: DeviceView) -> list[str]:
    """The plan as a table: one change a row, the peak predicted after it, and the alternatives under it."""
    assert d.plan is not None
    if not d.plan.fits:
        return ["**Plan:** no combination of the offered remedies fits.", ""]
    lines = ["**Plan** (one change at a time, cheapest first; stop at the first that fits):", "",
             "| step | change | peak allocated | peak reserved | fits | from |", "|--:|---|--:|--:|---|---|"]
    lines += [f"| {i} | {md_text(s.title)} | {human_bytes(s.peak_allocated_bytes)} | "
              f"{'' if s.peak_reserved_bytes is None else human_bytes(s.peak_reserved_bytes)} | "
              f"{'yes' if s.fits else 'not yet'} | {s.source} |" for i, s in enumerate(d.plan.steps, 1)]
    lines.append("")
    lines += [f"- or {md_text(changes)}: peak {human_bytes(peak)} ({md_text(cost)})"
              for changes, peak, cost in d.plan.alternatives]
    return lines + ([""] if d.plan.alternatives else [])


def _device(d: DeviceView, several: bool) -> list[str]:
    title = f"### {md_text(d.name)}: peak {human_bytes(d.peak_allocated_bytes)} allocated, " \
            f"{reserved(d.reserved_peak_bytes)}"
    lines = [title, ""]
    if several:
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
    if d.remedies:
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


def render_markdown(view: ReportView, chart_name: str | None) -> str:
    """The summary; `chart_name` is the PNG's path relative to the Markdown file (None: no chart)."""
    lines = [f"## GPU memory report: {md_code(Path(view.input.path).name)}", "",
             f"**Verdict:** {md_text(view.verdict)}", ""]
    if chart_name:
        lines += [f"![memory over time: allocated bytes by category, reserved bytes, phases, the peak and the OOM]"
                  f"({quote(chart_name)})", ""]
    if view.comparison is not None:
        lines += [f"**Imbalance:** {md_text(view.comparison.summary)}", ""]
        lines += [f"- {md_text(r)}" for r in view.comparison.remedies] + [""]
    if len(view.devices) > 1:
        lines += _overview(view.devices)
    for d in view.in_full():
        lines += _device(d, len(view.devices) > 1)
    if view.warnings:
        lines += ["**Warnings:**", ""] + [f"- {md_text(w)}" for w in view.warnings] + [""]
    lines.append(f"<sub>analyzer {view.version}; input {md_code(view.input.path)} ({md_text(view.input.torch_era)}); "
                 "the HTML report (`analyze FILE --format html`) has the stacks, fragmentation and theory.</sub>")
    return "\n".join(lines) + "\n"


def write_markdown(report: Report, out: Path) -> list[Path]:
    view = report_view(report)
    charts = [d.chart for d in view.in_full() if d.chart is not None]
    png = out.with_suffix(".png")
    if charts:
        save_png(memory_figure(charts), png)
    out.write_text(render_markdown(view, png.name if charts else None), encoding="utf-8")
    return [out, png] if charts else [out]
