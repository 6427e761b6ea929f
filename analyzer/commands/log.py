"""`analyze log RUNS.jsonl [-o log.html] [--format text|json|html]`: the runs `analyze FILE --log` recorded, a bar
of each one's peak, and the runs one change apart with the saving measured beside the saving predicted.

Two runs are one change apart when the later one's note names a remedy id the earlier one offered, or else when
their revealed configuration differs in one variable (analyzer.report.run_pairs). A malformed line is skipped
with a warning naming its line; a log without any run is exit code 2.
"""
from __future__ import annotations

import argparse
import io
import json
from functools import partial
from pathlib import Path

from rich.console import Console
from rich.text import Text

from analyzer.commands.analyze import write_report
from analyzer.core.printable import printable
from analyzer.report.run_log import read_log
from analyzer.report.run_log_render import log_document, print_log, render_log_html
from analyzer.report.run_pairs import pair_runs

_BY_SUFFIX = {".html": "html", ".htm": "html", ".json": "json", ".txt": "text"}


class LogCommand:
    description = __doc__

    def prepare_parser(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("log", type=Path, help="the run log (.jsonl) that analyze FILE --log appends to")
        parser.add_argument("-o", "--output", type=Path, help="write the log's page (.html) or JSON (.json) here")
        parser.add_argument("--format", choices=("text", "json", "html"),
                            help="default: from the suffix of -o, else text on the terminal")

    def run(self, args: argparse.Namespace) -> int:
        fmt = args.format or (_BY_SUFFIX.get(args.output.suffix.lower(), "html") if args.output else "text")
        log = read_log(args.log)
        warn = Console(stderr=True, highlight=False)
        for skipped in log.skipped:
            warn.print(Text(f"analyze log: warning: {printable(str(args.log))}: skipped {skipped}", style="yellow"),
                       soft_wrap=True)
        pairs = pair_runs(log.runs)
        if fmt == "text" and args.output is None:
            print_log(log, pairs, Console(highlight=False))
            return 0
        if fmt == "text":
            plain = Console(file=io.StringIO(), record=True, width=160, color_system=None)
            print_log(log, pairs, plain)
            text = plain.export_text()
        else:
            text = render_log_html(log, pairs) if fmt == "html" else json.dumps(log_document(log, pairs), indent=2)
        if args.output is None:
            print(text)
            return 0
        for path in write_report(partial(_write, text), args.output, False, [args.log]):
            Console(highlight=False).print(Text("log written to ") + Text(printable(str(path)), style="bold"))
        return 0


def _write(text: str, out: Path) -> list[Path]:
    out.write_text(text + "\n", encoding="utf-8")
    return [out]
