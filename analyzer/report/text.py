"""The terminal summary: per device the peak, the largest allocations live at it, and the OOM."""
from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from analyzer.analysis import Analysis
from analyzer.report.units import human_bytes, relative_seconds
from analyzer.stacks import short_frame


def print_summary(analysis: Analysis, console: Console, top: int = 5) -> None:
    trace = analysis.trace
    origin = trace.time_origin_us
    console.print(f"[bold]{escape(trace.source_path)}[/bold]  [dim]{escape(trace.source_kind)}, {escape(trace.torch_era)}[/dim]")
    for d in analysis.devices:
        console.print(
            f"\n[bold]cuda:{d.device}[/bold]  peak [bold]{human_bytes(d.peak.allocated_bytes)}[/bold] allocated "
            f"({human_bytes(d.peak.requested_bytes)} requested, {human_bytes(d.peak.reserved_bytes)} reserved) "
            f"at {relative_seconds(d.peak.time_us, origin)}, event {d.peak.event_index} of {d.trace_entries}; "
            f"reserved peak {human_bytes(d.reserved_peak_bytes)}"
        )
        if d.oom:
            where = f" from {escape(short_frame(d.oom.top_user_frame))}" if d.oom.top_user_frame else ""
            console.print(f"  [bold red]OUT OF MEMORY[/bold red] at {relative_seconds(d.oom.time_us, origin)}: tried to "
                          f"allocate {human_bytes(d.oom.requested_bytes)} with {human_bytes(d.oom.device_free_bytes)} "
                          f"free on the device{where}")
        rows = d.top_allocations(trace, top)
        if rows:
            table = Table(box=None, pad_edge=False, show_header=True, header_style="dim")
            table.add_column("allocated", justify="right")
            table.add_column("allocated by", overflow="fold")
            for r in rows:
                where = short_frame(r["top_user_frame"]) if r["top_user_frame"] else (
                    "no user frame" if r["has_frames"] else "no frames recorded")
                table.add_row(human_bytes(r["allocated_bytes"]), escape(where))
            console.print(table)
        console.print(f"  end: {human_bytes(d.end['allocated_bytes'])} allocated, {human_bytes(d.end['reserved_bytes'])} "
                      f"reserved, largest free block {human_bytes(d.end['largest_free_block_bytes'])}")
    for w in analysis.warnings:
        console.print(f"[yellow]warning:[/yellow] {escape(w)}")
