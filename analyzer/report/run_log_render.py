"""The log of runs shown: a table of the runs with a bar of each one's peak, then the pairs one change apart with
the saving measured beside the saving predicted; in the terminal (rich), as a small HTML page, or as JSON.

A log is an input file like any other (anyone can edit it): its paths and notes are escaped as the reports
escape them, `printable` text in the terminal, autoescaped by the reports' Jinja environment in the page,
whose Content-Security-Policy loads and runs nothing. The page's chart is a matplotlib SVG labelled with run
numbers only, so no string from the log is drawn into it.
"""
from __future__ import annotations

from typing import Any

from matplotlib.figure import Figure
from rich.console import Console
from rich.table import Table
from rich.text import Text

from analyzer.core.printable import printable
from analyzer.core.units import binary_unit, human_bytes
from analyzer.report.page import REPORT_CSS, TEMPLATES
from analyzer.report.plots import PEAK_COLOR, figure_svg
from analyzer.report.run_log import Run, RunLog
from analyzer.report.run_pairs import DevicePair, Pair
from analyzer.report.shown import shown

BAR_WIDTH = 12   # characters of the terminal bar of the largest peak
_FIT_COLOR = "#3b6fc4"


def outcome(run: Run) -> str:
    """'OOM' when a device ran out, 'fits' when every device fits with room, else 'no OOM' (ran, but tight or
    against a device the recording does not name)."""
    if any(d["oom"] for d in run.devices):
        return "OOM"
    return "fits" if all(d.get("fits") for d in run.devices) else "no OOM"


def _device_name(d: DevicePair) -> str:
    return f"rank {d.rank} cuda:{d.device}" if d.rank is not None else f"cuda:{d.device}"


def _signed(n: int) -> str:
    return ("-" if n < 0 else "") + human_bytes(abs(n))


def _predicted(d: DevicePair) -> str:
    return "no prediction" if d.predicted_saving_bytes is None else human_bytes(d.predicted_saving_bytes)


def _change(p: Pair, d: DevicePair) -> str:
    """'note names micro_batch'; 'gpus 1 -> 4: zero2 (closest estimate among zero1, zero2)'."""
    if d.remedy is None or d.how == "named in the note":
        return p.change
    return f"{p.change}: {d.remedy['id']} ({d.how})"


def _measured(d: DevicePair) -> str:
    reserved = d.remedy is not None and d.remedy["measure"] == "reserved"
    return _signed(d.measured_saving_bytes) + (" of reserved memory" if reserved else "")


def _ratio(d: DevicePair) -> str:
    return "" if d.ratio is None else f"{d.ratio:.0%}"


def _ooms(d: DevicePair) -> str:
    """'OOM gone' or 'now OOM' when the change flipped it, else nothing."""
    return {(True, False): "OOM gone", (False, True): "now OOM"}.get((d.before["oom"], d.after["oom"]), "")


def _when(time: str) -> str:
    """'2026-12-01 14:53' from the logged ISO time in UTC."""
    return time.replace("T", " ")[:16]


def _run_rows(log: RunLog) -> list[dict[str, Any]]:
    """One row a run, its strings made visible (`shown`), for the terminal and the page alike."""
    rows = [{"line": r.line, "time": _when(r.record["time"]), "input": r.record["input"],
             "note": r.record.get("note") or "", "needed": r.worst["needed_bytes"],
             "reserved": r.worst["peak_reserved_bytes"], "outcome": outcome(r)} for r in log.runs]
    return shown(rows)


def _pair_rows(pairs: list[Pair]) -> list[dict[str, Any]]:
    """One row a device of a pair, its strings made visible."""
    rows = [{"runs": f"#{p.before.line} -> #{p.after.line}", "device": _device_name(d), "change": _change(p, d),
             "needed_before": d.before["needed_bytes"], "needed_after": d.after["needed_bytes"], "ooms": _ooms(d),
             "measured": _measured(d), "predicted": _predicted(d), "ratio": _ratio(d)}
            for p in pairs for d in p.devices]
    return shown(rows)


def print_log(log: RunLog, pairs: list[Pair], console: Console) -> None:
    """The runs with a bar of each peak, then the pairs."""
    top = max(r.worst["needed_bytes"] for r in log.runs) or 1
    runs = Table(title="Runs", title_justify="left", header_style="dim", box=None, pad_edge=False)
    runs.add_column("#", justify="right", no_wrap=True)
    runs.add_column("time (UTC)", no_wrap=True)
    runs.add_column("input", overflow="fold", ratio=2)
    runs.add_column("note", overflow="fold", ratio=2)
    runs.add_column("peak", justify="right", no_wrap=True)
    runs.add_column("", no_wrap=True)
    runs.add_column("", no_wrap=True)
    for r in _run_rows(log):
        oom = r["outcome"] == "OOM"
        runs.add_row(str(r["line"]), Text(printable(r["time"])), Text(printable(r["input"])),
                     Text(printable(r["note"])), human_bytes(r["needed"]),
                     Text(r["outcome"], style="bold red" if oom else ""),
                     Text("█" * max(1, round(BAR_WIDTH * r["needed"] / top)), style="red" if oom else "blue"))
    console.print(runs)
    if not pairs:
        console.print(Text("\nNo two runs are one change apart (a note naming a remedy id, or one configuration "
                           "variable that differs).", style="dim"))
        return
    console.print(Text("\nOne change apart: the saving measured beside the saving predicted", style="italic"))
    for p in _pair_rows(pairs):   # two lines a device, readable at any width
        console.print(Text(f"{p['runs']} {p['device']}: ", style="bold") + Text(printable(p["change"])),
                      soft_wrap=True)
        ratio = f" ({p['ratio']} of predicted)" if p["ratio"] else ""
        flipped = f"; {p['ooms']}" if p["ooms"] else ""
        console.print(Text(f"  peak {human_bytes(p['needed_before'])} -> {human_bytes(p['needed_after'])}{flipped}; "
                           f"measured saving {p['measured']}, predicted {p['predicted']}{ratio}"), soft_wrap=True)


def log_document(log: RunLog, pairs: list[Pair]) -> dict[str, Any]:
    """The runs and pairs as JSON: the calibration data of the estimator, measured against predicted."""
    return {
        "runs": [{"line": r.line, **r.record} for r in log.runs],
        "skipped": log.skipped,
        "pairs": [{"before_line": p.before.line, "after_line": p.after.line, "change": p.change,
                   "devices": [{"device": d.device, "rank": d.rank, "remedy": d.remedy["id"] if d.remedy else None,
                                "chosen": d.how, "measure": d.remedy["measure"] if d.remedy else "needed",
                                "measured_saving_bytes": d.measured_saving_bytes,
                                "needed_saving_bytes": d.needed_saving_bytes,
                                "reserved_saving_bytes": d.reserved_saving_bytes,
                                "predicted_saving_bytes": d.predicted_saving_bytes, "ratio": d.ratio,
                                "oom_before": d.before["oom"], "oom_after": d.after["oom"]} for d in p.devices]}
                  for p in pairs],
    }


def peaks_svg(runs: list[Run]) -> str:
    """A horizontal bar of each run's peak, OOM runs in red, labelled '#line'."""
    scale, unit = binary_unit(max(r.worst["needed_bytes"] for r in runs) or 1)
    fig = Figure(figsize=(7, 0.6 + 0.28 * len(runs)), dpi=100, layout="constrained")
    ax = fig.subplots()
    ax.barh([f"#{r.line}" for r in runs], [r.worst["needed_bytes"] / scale for r in runs],
            color=[PEAK_COLOR if outcome(r) == "OOM" else _FIT_COLOR for r in runs])
    ax.invert_yaxis()
    ax.set_xlabel(f"peak (needed), {unit}")
    ax.spines[["top", "right"]].set_visible(False)
    return figure_svg(fig, "runs")


def render_log_html(log: RunLog, pairs: list[Pair]) -> str:
    return TEMPLATES.get_template("run_log.html.j2").render(rows=_run_rows(log), pairs=_pair_rows(pairs),
                                                            skipped=shown(log.skipped), chart=peaks_svg(log.runs),
                                                            css=REPORT_CSS)
