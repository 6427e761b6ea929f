"""The terminal summary: the verdict first, then per device what the peak is made of, the findings one line each
and the three cheapest remedies. Strings from the input are passed as `Text`, never as markup, each on one line with its controls escaped
(`printable`): a terminal would obey them."""
from __future__ import annotations

from rich.columns import Columns
from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from analyzer.core.units import human_bytes
from analyzer.report.job_report import Report, report_view
from analyzer.report.view import DeviceView, RecordingRow, Share, reserved, words
from analyzer.core.printable import printable
from analyzer.core.stacks import short_frame

TOP_MODULES = 5
TOP_REMEDIES = 3
TOP_LIVE = 5
_SEVERITY_STYLE = {"critical": "bold red", "warning": "yellow", "info": "dim"}


def _shares(rows: list[Share], title: str) -> Table:
    table = Table(box=None, pad_edge=False, header_style="dim", show_edge=False)
    table.add_column(title, overflow="fold", min_width=12)
    table.add_column("bytes", justify="right", no_wrap=True)
    table.add_column("share", justify="right", no_wrap=True)
    for r in rows:
        table.add_row(Text(printable(r.label)), human_bytes(r.bytes), f"{r.share:.0%}")
    return table


def _largest(d: DeviceView) -> Group:
    """The largest allocations live at the peak, each with the user line that made it."""
    table = Table(box=None, pad_edge=False, header_style="dim", show_edge=False)
    table.add_column("live at the peak", justify="right", no_wrap=True)
    table.add_column("category", no_wrap=True)
    table.add_column("allocated by (innermost user frame)", overflow="fold")
    for a in d.live[:TOP_LIVE]:
        table.add_row(human_bytes(a.allocated_bytes), words(a.category),
                      Text(printable(short_frame(a.where))) if a.where else
                      Text(printable(f"no user frame; {a.op}") if a.op else "no user frame recorded", style="dim"))
    return Group(table)


def _recordings(rows: list[RecordingRow]) -> Table:
    """Separate recordings analysed together: one row each, its fullest GPU's peak and its verdict."""
    table = Table(box=None, pad_edge=False, header_style="dim", show_edge=False)
    table.add_column("recording", no_wrap=True)
    table.add_column("peak", justify="right", no_wrap=True)
    table.add_column("verdict", overflow="fold", ratio=1)
    for r in rows:
        peak = "no GPU memory" if r.peak_bytes is None else f"{human_bytes(r.peak_bytes)} {r.device}"
        table.add_row(Text(printable(r.label)), Text(printable(peak)), Text(printable(r.verdict)))
    return table


def _findings(d: DeviceView) -> Table:
    table = Table(box=None, pad_edge=False, show_header=False, show_edge=False)
    table.add_column(no_wrap=True)
    table.add_column(no_wrap=True)
    table.add_column(justify="right", no_wrap=True)
    table.add_column(overflow="fold")
    for f in d.findings:
        table.add_row(Text(f.severity, style=_SEVERITY_STYLE.get(f.severity, "")), Text(words(f.kind)),
                      human_bytes(f.bytes) if f.bytes is not None else "", Text(printable(f.summary)))
    return table


def _remedies(d: DeviceView) -> Group:
    """One line a remedy (what, saving, new peak, fits), its first line of code under it: readable at any width."""
    lines: list[Text] = [Text(d.remedies_heading, style="dim")]
    for i, r in enumerate(d.remedies[:TOP_REMEDIES], 1):
        line = Text.assemble((printable(f"{i}. {r.title}"), "bold" if r.try_first else ""))
        if r.saved_bytes is not None and r.new_peak_bytes is not None:
            line.append(f": saves {human_bytes(r.saved_bytes)}, peak {human_bytes(r.new_peak_bytes)}")
        fits = None if r.fits is None else {True: (" (fits)", "green"), False: (" (still too large)", "red")}[r.fits]
        if fits:
            line.append(*fits)
        if r.confidence == "low":
            line.append(" (low confidence)", "yellow")
        if r.try_first:
            line.append("  ← try first" + (f" ({printable(r.plan_step)})" if r.plan_step else ""), "bold green")
        lines.append(line)
        if r.note:
            lines.append(Text("     " + r.note, style="dim"))
        how = (r.how or "").strip().splitlines()
        if how:
            lines.append(Text("     " + printable(how[0]) + (" …" if len(how) > 1 else ""), style="cyan"))
    return Group(*lines)


def _plan(d: DeviceView) -> Group:
    """The plan's steps, one change each with the peak predicted after it, then the alternatives."""
    assert d.plan is not None
    if not d.plan.fits:
        return Group(Text("plan: no combination of the offered remedies fits", style="dim"))
    lines = [Text("plan: one change at a time, cheapest first; stop at the first that fits", style="dim")]
    for i, step in enumerate(d.plan.steps, 1):
        line = Text(printable(f"{i}. {step.title}") + f": peak {human_bytes(step.peak_allocated_bytes)}")
        if step.peak_reserved_bytes is not None:
            line.append(f" ({human_bytes(step.peak_reserved_bytes)} reserved)")
        line.append(*((" fits", "green") if step.fits else (" not yet", "red")))
        line.append(f" [{step.source}]", "dim")
        lines.append(line)
    for changes, peak, cost in d.plan.alternatives:
        lines.append(Text(printable(f"   or {changes}: peak {human_bytes(peak)} ({cost})"), style="dim"))
    return Group(*lines)


def _device(d: DeviceView, console: Console, several: bool) -> None:
    head = Text.assemble((printable(d.name), "bold"), "  peak ", (human_bytes(d.peak_allocated_bytes), "bold"),
                         f" allocated ({human_bytes(d.peak_requested_bytes)} requested, "
                         f"{reserved(d.peak_reserved_bytes)}) at {d.peak_when}, event {d.peak_event} "
                         f"of {d.trace_entries}" + ("" if d.reserved_peak_bytes is None else
                                                    f"; highest reserved {human_bytes(d.reserved_peak_bytes)}"))
    console.print()
    console.print(head)
    if several:
        console.print(Text(printable(d.verdict)))
    if d.oom:
        line = Text.assemble(("  OUT OF MEMORY", "bold red"), f" at {d.oom.when}: asked for "
                             f"{human_bytes(d.oom.requested_bytes)} with {human_bytes(d.oom.device_free_bytes)} free")
        if d.oom.where:
            line.append(printable(f" from {short_frame(d.oom.where)}"))
        console.print(line)
    if d.by_category:
        console.print(Columns([_shares(d.by_category, "category"), _shares(d.by_phase, "phase"),
                               _shares(d.by_module[:TOP_MODULES], "top modules")], padding=(0, 4)))
    if d.live:
        console.print(_largest(d))
    if d.findings:
        console.print(Group(Text("findings", style="dim"), _findings(d)))
    if d.plan is not None:
        console.print(_plan(d))
    if d.remedies:
        console.print(_remedies(d))
    console.print(f"  end: {human_bytes(d.end['allocated_bytes'])} allocated, {reserved(d.end['reserved_bytes'])}, "
                  "largest free block "
                  + ("not recorded" if d.end["largest_free_block_bytes"] is None else human_bytes(d.end["largest_free_block_bytes"])))


def print_summary(report: Report, console: Console) -> None:
    if console.quiet:
        return
    view = report_view(report)
    console.print(Text(printable(view.verdict), style="bold"))
    console.print(Text.assemble((printable(view.input.path), ""), (f"  {view.input.kind}, {view.input.torch_era}", "dim")))
    if view.recordings is not None:
        console.print(_recordings(view.recordings))
    if view.comparison is not None:
        console.print(Text.assemble(("imbalance: ", "yellow"), printable(view.comparison.summary)))
        for remedy in view.comparison.remedies:
            console.print(Text(f"  - {printable(remedy)}"))
    for d in view.in_full():
        _device(d, console, len(view.devices) > 1)
    if len(view.in_full()) < len(view.devices):
        console.print(Text(f"{len(view.devices) - len(view.in_full())} more devices are in the report's overview",
                           style="dim"))
    for w in view.warnings:
        console.print(Text.assemble(("warning: ", "yellow"), printable(w)))
