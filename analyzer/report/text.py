"""The terminal summary: the verdict first, then per device what the peak is made of, the findings one line each
and the three cheapest remedies. Strings from the input are passed as `Text`, never as markup, each on one line with its controls escaped
(`printable`): a terminal would obey them."""
from __future__ import annotations

from rich.columns import Columns
from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from analyzer.core.printable import printable
from analyzer.core.stacks import short_frame
from analyzer.core.units import human_bytes
from analyzer.report.job_report import Report, report_view
from analyzer.report.page import reserved, words
from analyzer.report.terminal import Trimmed, indented
from analyzer.report.view import DeviceView, RecordingRow, ReportView, Share

TOP_MODULES = 5
TOP_REMEDIES = 3
TOP_LIVE = 5
_SEVERITY_STYLE = {"critical": "bold red", "warning": "yellow", "info": "dim"}


LIVE_COLUMNS = 32   # what the live-at-the-peak table's size and category columns take, with their gaps


def _shares(rows: list[Share], title: str) -> Table:
    table = Table(box=None, pad_edge=False, header_style="dim", show_edge=False)
    table.add_column(title, overflow="fold", min_width=12)
    table.add_column("bytes", justify="right", no_wrap=True)
    table.add_column("share", justify="right", no_wrap=True)
    for r in rows:
        table.add_row(Text(printable(r.label)), human_bytes(r.bytes), f"{r.share:.0%}")
    return table


def _left_cut(text: str, width: int) -> str:
    """`text` within `width` columns, shortened from the left ('…/models.py:231 forward'): the file, the line
    number and the function are never the part cut."""
    return text if len(text) <= width else "…" + text[len(text) - width + 1:]


def _right_cut(text: str, width: int) -> str:
    """`text` within `width` columns, its end cut after a separator ('aten::mm(float[32, …'): an operator's name
    comes first, and no number or name is cut in two."""
    if len(text) <= width:
        return text
    kept = text[: width - 1]
    at = max(kept.rfind(c) for c in " ,([")
    return (kept[: at + 1] if at > width // 2 else kept) + "…"


def _largest(d: DeviceView, width: int) -> Group:
    """The largest allocations live at the peak, each with the user line that made it."""
    table = Table(box=None, pad_edge=False, header_style="dim", show_edge=False)
    table.add_column("live at the peak", justify="right", no_wrap=True)
    table.add_column("category", no_wrap=True)
    table.add_column("allocated by (innermost user frame)", no_wrap=True)
    room = max(width - LIVE_COLUMNS, 24)
    for a in d.live[:TOP_LIVE]:
        table.add_row(human_bytes(a.allocated_bytes), words(a.category),
                      Text(_left_cut(printable(short_frame(a.where)), room)) if a.where else
                      Text(_right_cut(printable(f"no user frame; {a.op}"), room) if a.op else "no user frame recorded",
                           style="dim"))
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
    lines: list[RenderableType] = [Text(d.remedies_heading, style="dim")]
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
        lines.append(indented(line, 0, len(f"{i}. ")))
        if r.note:
            lines.append(indented(Text(printable(r.note), style="dim"), 5))
        how = (r.how or "").strip().splitlines()
        if how:
            lines.append(indented(Text(printable(how[0]) + (" …" if len(how) > 1 else ""), style="cyan"), 5))
    return Group(*lines)


def _plan(d: DeviceView) -> Group | None:
    """The plan's steps, one change each with the peak predicted after it, and the other combinations, when it
    combines changes; a plan of one change is the remedy marked 'try first' below, its alternatives the list's."""
    assert d.plan is not None
    if not d.plan.fits:
        return Group(Text("plan: no combination of the offered remedies fits", style="dim"))
    if len(d.plan.steps) < 2:
        return None
    lines: list[RenderableType] = [Text("plan: one change at a time, cheapest first; stop at the first that fits",
                                        style="dim")]
    for i, step in enumerate(d.plan.steps, 1):
        line = Text(printable(f"{i}. {step.title}") + f": peak {human_bytes(step.peak_allocated_bytes)}")
        if step.peak_reserved_bytes is not None:
            line.append(f" ({human_bytes(step.peak_reserved_bytes)} reserved)")
        line.append(*((" fits", "green") if step.fits else (" not yet", "red")))
        line.append(f" [{step.source}]", "dim")
        lines.append(indented(line, 0, len(f"{i}. ")))
    for changes, peak, cost in d.plan.alternatives:   # other combinations: the list below has single changes
        lines.append(indented(Text(printable(f"or {changes}: peak {human_bytes(peak)} ({cost})"), style="dim"), 3, 3))
    return Group(*lines)


def _when(d: DeviceView) -> str:
    """Where the peak is in the history: 'at 2.725 s, event 420 of 596'; before any event, or without one, said
    so (never 'event -1 of 1')."""
    if d.trace_entries == 0:
        return "in the end state (no history recorded)"
    if d.peak_event < 0:
        return "before the only recorded event" if d.trace_entries == 1 else \
            f"before the first of {d.trace_entries} recorded events"
    return f"at {d.peak_when}, event {d.peak_event} of {d.trace_entries}"


def _device(d: DeviceView, width: int, said: str) -> list[RenderableType]:
    """One device's lines; its verdict only when the summary's first line (`said`) is not already it."""
    head = Text.assemble((printable(d.name), "bold"), "  peak ", (human_bytes(d.peak_allocated_bytes), "bold"),
                         f" allocated ({human_bytes(d.peak_requested_bytes)} requested, "
                         f"{reserved(d.peak_reserved_bytes)}) {_when(d)}" + ("" if d.reserved_peak_bytes is None else
                                                    f"; highest reserved {human_bytes(d.reserved_peak_bytes)}"))
    out: list[RenderableType] = [Text(), head]
    if printable(d.verdict) not in said:
        out.append(Text(printable(d.verdict)))
    if d.oom:
        line = Text.assemble(("OUT OF MEMORY", "bold red"), f" at {d.oom.when}: asked for "
                             f"{human_bytes(d.oom.requested_bytes)} with {human_bytes(d.oom.device_free_bytes)} free")
        if d.oom.where:
            line.append(printable(f" from {short_frame(d.oom.where)}"))
        out.append(indented(line, 2))
    if d.by_category:
        out.append(Columns([_shares(d.by_category, "category"), _shares(d.by_phase, "phase"),
                            _shares(d.by_module[:TOP_MODULES], "top modules")], padding=(0, 4)))
    if d.live:
        out.append(_largest(d, width))
    if d.findings:
        out.append(Group(Text("findings", style="dim"), _findings(d)))
    plan = _plan(d) if d.plan is not None else None
    if plan is not None:
        out.append(plan)
    if d.remedies:
        out.append(_remedies(d))
    free = d.end["largest_free_block_bytes"]
    out.append(indented(Text(f"end: {human_bytes(d.end['allocated_bytes'])} allocated, "
                              f"{reserved(d.end['reserved_bytes'])}, largest free block "
                              + ("not recorded" if free is None else human_bytes(free))), 2))
    return out


def _input_line(view: ReportView) -> Text:
    """The input and what it is: 'run.json.gz  kineto (absolute microseconds)', each description once."""
    parts = list(dict.fromkeys(p.strip() for p in [view.input.kind, *view.input.torch_era.split(", ")] if p.strip()))
    described = [p for p in parts if not any(o != p and o.startswith(p) for o in parts)]   # not 'kineto, kineto (…)'

    return Text.assemble((printable(view.input.path), ""), (f"  {', '.join(described)}", "dim"))


def print_summary(report: Report, console: Console) -> None:
    if console.quiet:
        return
    view = report_view(report)
    out: list[RenderableType] = [Text(printable(view.verdict), style="bold"), _input_line(view)]
    if view.recordings is not None:
        out.append(_recordings(view.recordings))
    if view.comparison is not None:
        out.append(Text.assemble(("imbalance: ", "yellow"), printable(view.comparison.summary)))
        out += [indented(Text(f"- {printable(remedy)}"), 2, 2) for remedy in view.comparison.remedies]
    said = printable(view.verdict)
    for d in view.in_full():
        out += _device(d, console.width, said)
    if len(view.in_full()) < len(view.devices):
        out.append(Text(f"{len(view.devices) - len(view.in_full())} more devices are in the report's overview",
                        style="dim"))
    out += [indented(Text.assemble(("warning: ", "yellow"), printable(w)), 0, len("warning: ")) for w in view.warnings]
    for renderable in out:
        console.print(Trimmed(renderable))
