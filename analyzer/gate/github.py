"""A check in GitHub Actions: workflow-command annotations on the run's page and a Markdown job summary.

The annotation lines are those GitHub documents ("Workflow commands for GitHub Actions": `::error
title={title}::{message}`, `::warning ...`). A message ends at the first line break, so its data is escaped as
actions/toolkit's packages/core/src/command.ts escapes it: `%` as %25, CR as %0D, LF as %0A (the runner
decodes them, so a message of several lines stays one command); a property (the title) also escapes `:` as %3A
and `,` as %2C, which would otherwise end it. The summary is appended to the file $GITHUB_STEP_SUMMARY names.
"""
from __future__ import annotations

import os
from pathlib import Path

from analyzer.core.units import format_bytes
from analyzer.errors import OutputError
from analyzer.gate.compare import Check
from analyzer.gate.render import details, headline
from analyzer.report.markdown import md_text

ENV_ACTIONS = "GITHUB_ACTIONS"
ENV_SUMMARY = "GITHUB_STEP_SUMMARY"


def in_actions() -> bool:
    return os.environ.get(ENV_ACTIONS) == "true"


def escape_data(text: str) -> str:
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def escape_property(text: str) -> str:
    return escape_data(text).replace(":", "%3A").replace(",", "%2C")


def command(name: str, message: str, **properties: str) -> str:
    """One workflow command line: `::name key=value,key=value::message`, every part escaped."""
    props = ",".join(f"{key}={escape_property(value)}" for key, value in properties.items())
    return f"::{name}{' ' + props if props else ''}::{escape_data(message)}"


def annotation_lines(check: Check) -> list[str]:
    """An error for each device that does not hold (its headline, then what grew, line by line), a warning for
    a baseline grown stale and for each warning of the check."""
    lines = []
    for d in check.devices:
        if not d.holds:
            lines.append(command("error", "\n".join([headline(d, check), *details(d, check)]),
                                 title=f"GPU memory check failed on {d.now.label}"))
        elif d.stale:
            lines.append(command("warning", headline(d, check), title=f"GPU memory baseline stale on {d.now.label}"))
    lines += [command("warning", w, title="GPU memory check") for w in check.warnings]
    return lines


def summary_markdown(check: Check) -> str:
    """The job summary: one row per device, then what grew for each device that failed."""
    limit = "budget" if check.budget_bytes is not None else "limit"
    lines = [f"### GPU memory check: {'holds' if check.holds else 'FAILED'}", "",
             f"Run {md_text(check.run)} against " + (f"a budget of {format_bytes(check.budget_bytes)}"
                                                   if check.budget_bytes is not None else
                                                   f"the baseline {md_text(check.baseline or '')} "
                                                   f"(tolerance {check.tolerance:.0%})") + ".", "",
             f"| device | needed | baseline | {limit} | verdict |", "|---|---:|---:|---:|---|"]
    for d in check.devices:
        was = "" if d.then is None else format_bytes(d.then.needed_bytes)
        verdict = "holds" if d.holds else "**fails**"
        lines.append(f"| {md_text(d.now.label)} | {format_bytes(d.now.needed_bytes)} | {was} | "
                     f"{format_bytes(d.limit_bytes) if d.limit_bytes is not None else ''} | {verdict} |")
    for d in check.devices:
        if not d.holds:
            lines += ["", f"**{md_text(headline(d, check))}**", "", *(f"- {md_text(x)}" for x in details(d, check))]
    lines += ["", *(f"> warning: {md_text(w)}" for w in check.warnings)]
    return "\n".join(lines).rstrip() + "\n"


def append_summary(check: Check, path: Path) -> None:
    try:
        with open(path, "a", encoding="utf-8") as stream:
            stream.write(summary_markdown(check) + "\n")
    except OSError as error:
        raise OutputError(path, f"the job summary cannot be appended ({error.strerror or error})",
                          f"Check ${ENV_SUMMARY}.") from None
