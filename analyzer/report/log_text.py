"""The terminal summary of a log's analysis: the verdict, then per OOM its numbers, cause and remedies, then what
the memory lines show and what to record next. Every string from the log is printed as `Text` through
`printable` (a terminal obeys the controls a log may hold)."""
from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text

from analyzer.core.log_records import gpu_name
from analyzer.core.printable import printable
from analyzer.core.units import human_bytes
from analyzer.log_result import LogAnalysis, LogOom
from analyzer.report.terminal import Trimmed, indented

TOP_REMEDIES = 3
#: (label, JSON key of LogOom.to_json()) of the numbers shown per OOM, in the message's order
NUMBERS = [("requested", "requested_bytes"), ("total capacity", "capacity_bytes"), ("free", "free_bytes"),
           ("allowed", "allowed_bytes"), ("allocated by PyTorch", "allocated_bytes"),
           ("reserved by PyTorch", "reserved_bytes"), ("reserved but unallocated", "unallocated_bytes"),
           ("this process (NVML)", "this_process_bytes"), ("outside PyTorch, this process", "non_pytorch_bytes"),
           ("in private pools", "private_pool_bytes"), ("outside PyTorch's cache", "outside_bytes"),
           ("must be freed", "must_free_bytes")]


def numbers_table(o: dict[str, object]) -> list[tuple[str, int]]:
    """(label, bytes) of the numbers an OOM has, in NUMBERS order (shared by the renderers)."""
    return [(label, value) for label, key in NUMBERS if isinstance(value := o.get(key), int)]


def _said(console: Console, text: Text, indent: int = 2, hang: int = 0) -> None:
    """A line at `indent` whose wrapped lines keep it (plus `hang`), with no space at the ends of its lines."""
    console.print(Trimmed(indented(text, indent, hang)))


def _code(console: Console, code: str, indent: int) -> None:
    """Code as it is to be typed: never wrapped inside (the terminal folds a long line, copying keeps it whole)."""
    for line in code.splitlines():
        console.print(Text(" " * indent + printable(line), style="cyan"), soft_wrap=True)


def _oom(console: Console, oom: LogOom, index: int) -> None:
    o = oom.to_json()
    head = Text(f"OOM {index} ", style="bold") + Text(printable(f"line {o['line']}"), style="dim")
    if o["repeats"] > 1:
        head += Text(f" (printed {o['repeats']} times)", style="dim")
    console.print(head)
    _said(console, Text("cause: ") + Text(o["cause"], style="bold red") + Text(printable(f" — {o['reason']}")))
    if o["phase"] or o["user_frame"]:
        _said(console, Text(printable(f"phase: {o['phase'] or 'unknown'}; your frame: {o['user_frame'] or 'none printed'}")))
    table = Table(box=None, pad_edge=False, show_header=False, show_edge=False)
    table.add_column(no_wrap=True)
    table.add_column(justify="right", no_wrap=True)
    for label, value in numbers_table(o):
        table.add_row(f"  {label}", human_bytes(value))
    for p in o["other_processes"]:
        table.add_row(Text(printable(f"  process {p['pid']}")), human_bytes(p["bytes"]))
    console.print(Trimmed(table))
    for note in [*o["inconsistent"], *o["notes"]]:
        _said(console, Text(printable(f"note: {note}"), style="yellow"))
    for i, r in enumerate(o["remedies"][:TOP_REMEDIES], 1):
        saves = f" ({human_bytes(r['bytes'])})" if r["bytes"] else ""
        _said(console, Text(printable(f"{i}. {r['title']}{saves}: {r['detail']}")), hang=len(f"{i}. "))
        if r["code"]:
            _code(console, r["code"], 7)


def print_log_summary(report: LogAnalysis, console: Console) -> None:
    console.print(Trimmed(Text(printable(report.verdict), style="bold")))
    for i, oom in enumerate(report.ooms, 1):
        console.print()
        _oom(console, oom, i)
    if report.findings or report.gpu_peaks or report.gpu_processes or report.memory_highs:
        console.print()
        console.print(Text("across the log", style="dim"))
    for f in report.findings:
        remedy = f"; try: {f['remedy']}" if f.get("remedy") else ""
        _said(console, Text(printable(f"{f['kind']}: {f['summary']}{remedy}")))
    for p in report.gpu_peaks:
        total = f" of {human_bytes(p['total_bytes'])}" if p["total_bytes"] else ""
        _said(console, Text(f"{gpu_name(p['device'])}: at most {human_bytes(p['used_bytes'])}{total} used "
                            f"(nvidia-smi, {p['readings']} readings)"))
    for process in report.gpu_processes:
        _said(console, Text(printable(f"{gpu_name(process['device'])}: {process['process']} uses "
                                      f"{human_bytes(process['used_bytes'])}")))
    for high in report.memory_highs:
        _said(console, Text(printable(high["summary"])))
    for w in report.warnings:
        _said(console, Text(printable(f"warning: {w}"), style="yellow"), indent=0)
    console.print()
    console.print(Text("what to record next, to analyse the next OOM in full:", style="dim"))
    _code(console, report.to_json()["record_next"]["snapshot"], 0)
