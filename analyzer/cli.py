"""The `analyze` command.

    analyze FILE [NSYS.sqlite] [-o OUT] [--format html|json|md|pdf] [--gpu-memory SIZE] [--gpus N] [--quiet]
    analyze SUBCOMMAND ...        (see SUBCOMMANDS)

Bad input ends with one line on stderr naming the file and the problem, and exit code 2. An unexpected
error is a bug of ours: one line, exit code 1, and the traceback only with ANALYZER_DEBUG=1.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import traceback
from pathlib import Path

from rich.console import Console

from analyzer import __version__
from analyzer.errors import EXIT_BAD_INPUT, AnalyzerError, UnsupportedFormat
from analyzer.report import REPORTERS, SUFFIXES, reporter
from analyzer.sizes import parse_bytes

EXIT_INTERNAL = 1

#: subcommand -> "module:function(argv: list[str]) -> int"; `analyze NAME ...` runs it
SUBCOMMANDS: dict[str, str] = {
    "diff": "analyzer.diff:diff_command",
    "estimate": "analyzer.estimate:estimate_command",
    "simulate": "analyzer.simulate.cli:simulate_command",
    "run": "analyzer.capture_run:run_command",
}

_STRIP_SUFFIXES = (".gz", ".json", ".pickle", ".pkl", ".sqlite", ".tar")


def default_output(source: Path, fmt: str) -> Path:
    """`<input minus its data suffixes>.<format>` beside the input, or in the current folder if that is read-only."""
    name = source.name
    while any(name.endswith(s) for s in _STRIP_SUFFIXES) and "." in name:
        name = name[: name.rindex(".")]
    folder = source.parent if os.access(source.parent, os.W_OK) else Path.cwd()
    return folder / f"{name}.analysis{SUFFIXES[fmt]}"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="analyze",
        description="Explain why a PyTorch run ran out of GPU memory, and what to change first, from what it "
                    "recorded: a CUDA memory snapshot (torch.cuda.memory._dump_snapshot), a PyTorch Profiler trace "
                    "(.json/.json.gz, a directory or .tar.gz of ranks), an export_memory_timeline file or an Nsight "
                    "Systems export (.sqlite). Prints a summary and writes a report.",
        epilog="Subcommands: " + (", ".join(sorted(SUBCOMMANDS)) or "none yet") + " (analyze SUBCOMMAND --help).",
    )
    parser.add_argument("file", type=Path, help="the recording to analyse")
    parser.add_argument("companion", type=Path, nargs="?",
                        help="an Nsight Systems export (.sqlite) of the same run, to measure memory outside PyTorch")
    parser.add_argument("-o", "--output", type=Path, help="where to write the report (default: beside the input; "
                                                          "for json, standard output)")
    parser.add_argument("--format", choices=sorted(REPORTERS), default="html", help="report format (default: html)")
    parser.add_argument("-q", "--quiet", action="store_true", help="print nothing but errors")
    parser.add_argument("--gpu-memory", type=parse_bytes, help="device memory, e.g. 80GiB (default: what the input "
                                                                "records, or what the OOM shows)")
    parser.add_argument("--gpus", type=int, help="GPUs the job can shard over (for ZeRO / parallelism estimates)")
    parser.add_argument("--export-trace", type=Path, metavar="OUT.json",
                        help="for a profiler trace: write it again with counter tracks of allocated bytes by category "
                             "and by phase, for Perfetto UI / chrome://tracing (.gz to compress)")
    parser.add_argument("--version", action="version", version=f"analyze {__version__}")
    return parser


def analyze_command(argv: list[str]) -> int:
    from analyzer.analysis import analyze, combine_json
    from analyzer.ingest import load_with_companion
    from analyzer.trace import MultiRankTrace
    from analyzer.progress import reading_progress
    from analyzer.report.trace_export import export_trace

    args = _parser().parse_args(argv)
    json_to_stdout = args.format == "json" and args.output is None
    console = Console(stderr=json_to_stdout, quiet=args.quiet or json_to_stdout, highlight=False)
    with reading_progress(Console(stderr=True), enabled=sys.stderr.isatty() and not args.quiet):
        trace, device_usage = load_with_companion(args.file, args.companion)
    traces = trace.traces if isinstance(trace, MultiRankTrace) else [trace]
    with console.status("analysing"):
        analyses = [analyze(t, args.gpu_memory, args.gpus, device_usage) for t in traces]
    out = args.output if args.output or json_to_stdout else default_output(args.file, args.format)
    if len(analyses) > 1 and args.format == "json":  # one document for the job, each device tagged with its rank
        for a in analyses:
            _summary(a, console)
        text = json.dumps(combine_json(str(args.file), analyses), indent=2)
        if out is None:
            sys.stdout.write(text + "\n")
        else:
            out.write_text(text + "\n", encoding="utf-8")
            console.print(f"\nreport written to [bold]{out}[/bold]")
        return 0
    if args.export_trace is not None:
        if len(analyses) != 1:
            raise UnsupportedFormat(args.file, "--export-trace takes one profiler trace, not a set of ranks",
                                    "Pass one rank's .json(.gz) trace.")
        for path in export_trace(analyses[0], args.export_trace):
            console.print(f"trace with memory counters written to [bold]{path}[/bold]")
    for a in analyses:  # the report first: a closed pipe on stdout (| head) must not cost the user the file
        target = out if len(analyses) == 1 else out.with_name(f"{out.stem}.rank{a.trace.rank}{out.suffix}")
        written = reporter(args.format)(a, target)
        if len(analyses) > 1:
            console.rule(f"rank {a.trace.rank}")
        _summary(a, console)
        for path in written:
            console.print(f"\nreport written to [bold]{path}[/bold]")
    return 0


def _summary(analysis, console: Console) -> None:
    """The terminal summary, not even built when nothing would be printed (-q, JSON on stdout)."""
    if not console.quiet:
        from analyzer.report.text import print_summary

        print_summary(analysis, console)


def _run_subcommand(name: str, argv: list[str]) -> int:
    module, function = SUBCOMMANDS[name].split(":")
    return getattr(importlib.import_module(module), function)(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        if argv and argv[0] in SUBCOMMANDS:
            return _run_subcommand(argv[0], argv[1:])
        return analyze_command(argv)
    except AnalyzerError as error:
        print(f"analyze: error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("analyze: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except Exception as error:  # a bug of ours: one line, never a traceback unless asked for
        if os.environ.get("ANALYZER_DEBUG"):
            traceback.print_exc()
        print(f"analyze: internal error: {type(error).__name__}: {error}. Please report it with the input "
              "(set ANALYZER_DEBUG=1 for the traceback).", file=sys.stderr)
        return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
