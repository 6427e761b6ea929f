"""`analyze check RUN (--budget SIZE | --baseline OLD [--tolerance P%]) [--write-baseline FILE] [--format text|json]`:
a memory gate for CI that says what grew.

RUN and OLD are anything analyze reads (a snapshot, a trace, a folder of ranks), an earlier `analyze --format
json` result, a baseline file written by --write-baseline, or (OLD) Megatron-LM functional tests' golden values
(their mem-max-allocated-bytes). A device holds a budget when the memory it needed (its allocated peak, or at an
OOM allocated + the request that failed) is at most SIZE; it holds a baseline when that is at most OLD's peak
times (1 + P%), P = 5 by default (Megatron-LM's tolerance for the same number).

Exit codes: 0 the run holds; 1 it is over the budget or grew past the tolerance (what grew is printed); 2 bad
input (one line saying what is wrong). With GITHUB_ACTIONS=true, ::error / ::warning annotations are printed
too and a Markdown summary is appended to $GITHUB_STEP_SUMMARY.
"""
from __future__ import annotations

import argparse
import json
import os
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from analyzer.core.units import parse_bytes
from analyzer.errors import AnalyzerError

if TYPE_CHECKING:
    from analyzer.gate.compare import Check


def parse_tolerance(text: str) -> float:
    """'5%' or '5' is 0.05: a tolerance is given in percent."""
    number = text.strip().removesuffix("%")
    try:
        value = float(number) / 100
    except ValueError:
        raise AnalyzerError(None, f"--tolerance {text}: not a percentage", "Use e.g. --tolerance 5%.") from None
    if not 0 <= value < 10:
        raise AnalyzerError(None, f"--tolerance {text}: out of range", "Use a percentage from 0% to 999%.")
    return value


def parse_budget(text: str) -> int:
    try:
        budget = parse_bytes(text)
    except ValueError:
        raise AnalyzerError(None, f"--budget {text}: not a size", "Use e.g. --budget 40GiB.") from None
    if budget <= 0:
        raise AnalyzerError(None, f"--budget {text}: a budget must be more than nothing", "Use e.g. --budget 40GiB.")
    return budget


class CheckCommand:
    description = __doc__

    def prepare_parser(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("run", type=Path, help="the run to check: a recording, a JSON result or a baseline")
        parser.add_argument("--budget", metavar="SIZE", help="the most memory a device may need, e.g. 40GiB")
        parser.add_argument("--baseline", type=Path, metavar="OLD",
                            help="what the run may not grow past: a recording, a JSON result, a baseline file, or "
                                 "Megatron-LM golden values")
        parser.add_argument("--tolerance", default="5%", metavar="P%",
                            help="growth past the baseline allowed, in percent (default 5%%)")
        parser.add_argument("--write-baseline", type=Path, metavar="FILE",
                            help="write RUN's peaks and their breakdowns (not its events) as a baseline file")
        parser.add_argument("--format", choices=("text", "json"), default="text")

    def run(self, args: argparse.Namespace) -> int:
        from analyzer.gate.compare import check_baseline, check_budget
        from analyzer.gate.inputs import read_run

        if args.budget is None and args.baseline is None and args.write_baseline is None:
            raise AnalyzerError(None, "check needs --budget SIZE or --baseline OLD (one of them)",
                                "See analyze check --help.")
        if args.budget is not None and args.baseline is not None:
            raise AnalyzerError(None, "--budget and --baseline are two checks: pass one of them",
                                "Run analyze check twice to apply both.")
        budget = parse_budget(args.budget) if args.budget is not None else None
        tolerance = parse_tolerance(args.tolerance)
        baseline = read_run(args.baseline) if args.baseline is not None else None
        run = read_run(args.run, budget)
        if args.write_baseline is not None:
            _write_baseline(run.to_baseline(), args.write_baseline)
        check = check_budget(run, budget) if budget is not None else \
            check_baseline(run, baseline, tolerance) if baseline is not None else None
        if check is None:
            return 0
        _report(check, args.format)
        return check.exit_code


def _report(check: Check, fmt: str) -> None:
    """The check on stdout (text, or JSON); in GitHub Actions its annotations after the text, and its summary."""
    from analyzer.gate import github
    from analyzer.gate.render import check_document, render_text

    print(json.dumps(check_document(check), indent=2) if fmt == "json" else render_text(check))
    if not github.in_actions():
        return
    if fmt == "text":
        for line in github.annotation_lines(check):
            print(line)
    summary = os.environ.get(github.ENV_SUMMARY)
    if summary:
        github.append_summary(check, Path(summary))


def _write_baseline(document: dict[str, Any], out: Path) -> None:
    """Written whole or not at all, as reports are (a reader of the repository never sees half a baseline)."""
    from analyzer.commands.analyze import write_report

    write_report(partial(_write_json, document), out, False)


def _write_json(document: dict[str, Any], path: Path) -> list[Path]:
    path.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    return [path]
