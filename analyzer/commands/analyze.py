"""`analyze FILE [NSYS.sqlite] [-o OUT] [--format html|json|md|pdf] [--gpu-memory SIZE] [--gpus N] [--quiet]
[--source-root DIR ...] [--log RUNS.jsonl [--note TEXT]]`:
analyse one recording (or a set of ranks), write the report, print the summary, and append the run to the log."""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from pathlib import Path

from rich.console import Console
from rich.text import Text

from analyzer import __version__
from analyzer.core.printable import printable
from analyzer.core.units import parse_bytes
from analyzer.core.vocabulary import RUN_LOG_ENV
from analyzer.errors import AnalyzerError, OutputError, UnsupportedFormat
from analyzer.report import REPORTERS, SUFFIXES, reporter
from analyzer.report.job_report import Report

_STRIP_SUFFIXES = (".gz", ".json", ".pickle", ".pkl", ".sqlite", ".tar", ".log", ".txt")
#: names tried for the files a report writes beside itself before giving up (`notes.png`, `notes-1.png`, ...)
_FREE_NAME_ATTEMPTS = 100


def default_output(source: Path, fmt: str) -> Path:
    """`<input minus its data suffixes>.<format>` beside the input, or in the current folder if that is read-only."""
    name = source.name
    while any(name.endswith(s) for s in _STRIP_SUFFIXES) and "." in name:
        name = name[: name.rindex(".")]
    folder = source.parent if os.access(source.parent, os.W_OK) else Path.cwd()
    return folder / f"{name}.analysis{SUFFIXES[fmt]}"


class AnalyzeCommand:
    description = ("Explain why a PyTorch run ran out of GPU memory, and what to change first, from what it "
                   "recorded: a CUDA memory snapshot (torch.cuda.memory._dump_snapshot), a PyTorch Profiler trace "
                   "(.json/.json.gz, a directory or .tar.gz of ranks), an export_memory_timeline file or an Nsight "
                   "Systems export (.sqlite). Prints a summary and writes a report.")

    def prepare_parser(self, parser: argparse.ArgumentParser) -> None:
        from analyzer.commands import COMMANDS

        parser.formatter_class = argparse.HelpFormatter
        parser.epilog = "Subcommands: " + ", ".join(sorted(COMMANDS)) + " (analyze SUBCOMMAND --help)."
        parser.add_argument("file", type=Path, help="the recording to analyse, or a text log (the OOM message, "
                                                    "memory_summary(), nvidia-smi, framework memory lines); - reads "
                                                    "the text from standard input")
        parser.add_argument("companion", type=Path, nargs="?",
                            help="an Nsight Systems export (.sqlite) of the same run, to measure memory outside PyTorch")
        parser.add_argument("-o", "--output", type=Path, help="where to write the report (default: beside the input; "
                                                              "for json, standard output)")
        parser.add_argument("--format", choices=sorted(REPORTERS), help="report format (default: from the suffix of "
                                                                         "-o, else html)")
        parser.add_argument("-q", "--quiet", action="store_true", help="print nothing but errors")
        parser.add_argument("--gpu-memory", type=parse_bytes, help="device memory, e.g. 80GiB (default: what the "
                                                                    "input records, or what the OOM shows)")
        parser.add_argument("--gpus", type=int, help="GPUs the job can shard over (for ZeRO / parallelism estimates)")
        parser.add_argument("--export-trace", type=Path, metavar="OUT.json",
                            help="for a profiler trace: write it again with counter tracks of allocated bytes by "
                                 "category and by phase, for Perfetto UI / chrome://tracing (.gz to compress)")
        parser.add_argument("--source-root", type=Path, action="append", default=[], metavar="DIR",
                            help="a local checkout of the code the recording ran (repeatable), e.g. your project "
                                 "and the site-packages of the environment that ran it: frames are matched to its "
                                 "files by the longest common path suffix, so module class names can be read from "
                                 "them (never imported). Without it no local file is read, so one recording gives "
                                 "one report on every machine; `--source-root /` reads the recorded paths as they "
                                 "are here")
        parser.add_argument("--scheduler", metavar="ADDRESS",
                            help="for a folder of ranks: the Dask scheduler to run them on, tcp:// or tls:// "
                                 "(with Dask's TLS settings) HOST:PORT (default: $ANALYZER_DASK_SCHEDULER, else a "
                                 "local cluster with one worker per core, on loopback, TLS with its own "
                                 "credentials). Dask trusts the scheduler: it unpickles its replies, so connect "
                                 "only to a cluster you run")
        parser.add_argument("--workers", type=int, metavar="N",
                            help="for a folder of ranks on the local cluster: how many ranks run at once "
                                 "(default: the number of cores)")
        parser.add_argument("--log", type=Path, metavar="RUNS.jsonl",
                            help="append one line about this run (peaks, verdict, configuration, predicted savings) "
                                 f"to this log; `analyze log RUNS.jsonl` shows it (default: ${RUN_LOG_ENV})")
        parser.add_argument("--note", metavar="TEXT", help="a note kept with the run in the log, e.g. the change "
                                                           "made since the last run (a remedy id pairs the two runs)")
        parser.add_argument("--version", action="version", version=f"analyze {__version__}")

    def run(self, args: argparse.Namespace) -> int:
        args.format = args.format or format_for(args.output)
        if _is_log(args.file):
            return self._log(args)
        json_to_stdout = args.format == "json" and args.output is None
        console = Console(stderr=json_to_stdout, quiet=args.quiet or json_to_stdout, highlight=False)
        with _run_log(args.log or (Path(os.environ[RUN_LOG_ENV]) if os.environ.get(RUN_LOG_ENV) else None),
                      args.note) as log:
            report = self._job(args, console) if args.file.is_dir() else self._recording(args, console)
            out = args.output if args.output or json_to_stdout else default_output(args.file, args.format)
            # the report first: a closed pipe on stdout (| head) must not cost the user the file
            inputs = [p for p in (args.file, args.companion) if p is not None]
            if out:
                written = write_report(partial(reporter(args.format), report), out, args.output is None, inputs)
            else:
                written = reporter(args.format)(report, None)
            log(report)
        _summary(report, console)
        for path in written:
            _written(console, "\nreport written to", path)
        return 0

    @staticmethod
    def _log(args: argparse.Namespace) -> int:
        """A text log (or standard input): read streamed, judged per OOM, reported by the log reporters."""
        from analyzer.log_result import analyze_log
        from analyzer.report import LOG_REPORTERS
        from analyzer.report.log_text import print_log_summary

        source = None if str(args.file) == "-" else args.file
        if args.format not in LOG_REPORTERS:
            raise UnsupportedFormat(source, f"a log's report is {', '.join(sorted(LOG_REPORTERS))}, not {args.format}",
                                    "Pass --format html, md or json.")
        if args.companion is not None or args.export_trace is not None or args.log is not None or args.note is not None:
            raise UnsupportedFormat(source, "a text log is analysed alone (no Nsight export, --export-trace or run "
                                    "log)", "Drop those options for a log.")
        json_to_stdout = args.format == "json" and args.output is None
        console = Console(stderr=json_to_stdout, quiet=args.quiet or json_to_stdout, highlight=False)
        report = analyze_log(args.file)
        write = reporter(args.format, LOG_REPORTERS)
        out = args.output if args.output or json_to_stdout or source is None else default_output(source, args.format)
        written = write_report(partial(write, report), out, args.output is None) if out else \
            (write(report, None) if json_to_stdout else [])
        if not console.quiet:
            print_log_summary(report, console)
        for path in written:
            _written(console, "\nreport written to", path)
        return 0

    @staticmethod
    def _recording(args: argparse.Namespace, console: Console) -> Report:
        """One file (a .tar.gz of ranks included): read and analysed here."""
        from analyzer.commands.progress import reading_progress
        from analyzer.ingest import load_with_companion
        from analyzer.pipeline import analyze
        from analyzer.result import RankSetAnalysis

        with reading_progress(Console(stderr=True), enabled=sys.stderr.isatty() and not args.quiet):
            loaded, device_usage = load_with_companion(args.file, args.companion)
        with console.status("analysing"):
            result = analyze(loaded, args.gpu_memory, args.gpus, device_usage, source_roots=args.source_root)
        if args.export_trace is not None:
            if isinstance(result, RankSetAnalysis):
                raise UnsupportedFormat(args.file, "--export-trace takes one profiler trace, not a set of ranks",
                                        "Pass one rank's .json(.gz) trace.")
            from analyzer.ingest.chrome_copy import copy_of  # imported only when asked for (as below)
            from analyzer.report.trace_export import export_trace

            original = copy_of(result.trace)
            for path in write_report(partial(export_trace, result, original), args.export_trace, False,
                                     [args.file]):
                _written(console, "trace with memory counters written to", path)
        if not isinstance(result, RankSetAnalysis):
            return result
        from analyzer.commands.job_view import job_report, rank_shown
        from analyzer.job import job_of  # a set of ranks only: its reader imports ijson and asyncio

        return job_report(job_of(result, rank_shown))

    @staticmethod
    def _job(args: argparse.Namespace, console: Console) -> Report:
        """A folder of per-rank files: each rank analysed on Dask (analyzer.job), one report for the job."""
        from analyzer.commands.job_view import job_report, rank_shown
        from analyzer.job import RankOptions, analyze_job

        if args.companion is not None or args.export_trace is not None:
            raise UnsupportedFormat(args.file, "a folder of ranks is analysed alone (no Nsight export, no "
                                    "--export-trace)", "Pass one rank's file to use those options.")
        options = RankOptions(args.gpu_memory, args.gpus, tuple(str(r) for r in args.source_root))
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        progress = Progress(TextColumn("analysing ranks"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                            console=Console(stderr=True), transient=True, disable=args.quiet or not sys.stderr.isatty())
        task = progress.add_task("ranks", total=None)
        with progress:
            job = analyze_job(args.file, rank_shown, options, scheduler=args.scheduler, workers=args.workers,
                              on_done=lambda _, total: progress.update(task, total=total, advance=1))
        return job_report(job)


def _is_log(path: Path) -> bool:
    """`-` (standard input) or a file whose bytes are a text log (analyzer.ingest.sniff decides)."""
    from analyzer.ingest import sniff

    return str(path) == "-" or (not path.is_dir() and sniff.sniff(sniff.check_path(path)) == sniff.LOG)


@contextmanager
def _run_log(path: Path | None, note: str | None) -> Iterator[Callable[[Report], None]]:
    """What logs the run once analysed: nothing without a log; with one, the log is opened before the analysis,
    so that a path that cannot be written is told at once."""
    if path is None:
        if note is not None:
            raise AnalyzerError(None, "--note is kept in the run log, and no log was given",
                                f"Pass --log RUNS.jsonl, or set {RUN_LOG_ENV}.")
        yield lambda report: None
        return
    from analyzer.report.run_log import appending, document_of, log_line  # only with a log: not on a log's path

    with appending(path) as append:
        yield lambda report: append(log_line(document_of(report), note))


def format_for(output: Path | None) -> str:
    """The format `-o` names by its suffix (`x.pdf` is a PDF), else html."""
    by_suffix = {suffix: fmt for fmt, suffix in SUFFIXES.items()}
    return by_suffix.get(output.suffix.lower(), "html") if output is not None else "html"


def write_report(write: Callable[[Path], list[Path]], target: Path, default: bool,
                 inputs: Sequence[Path] = ()) -> list[Path]:
    """Write the report's files through `write(path)` into a private folder beside `target`, then rename each into
    place: a rename replaces a symbolic link instead of writing through it, and a reader never sees half a file.
    At the default path (beside an input someone else may have written) a link where a file will go is refused.
    The report never replaces one of `inputs`, and a file it writes beside `target` (the Markdown's chart) never
    replaces an existing file: it is written as `<target stem>-N` instead, the first N whose files are all free.
    A target that is a device (/dev/null, /dev/stdout) is written directly. Every failure is one OutputError."""
    folder = target.parent
    try:
        if target.is_dir():
            raise OutputError(target, "is a directory", "Pass -o a file name, e.g. -o report.html.")
        if any(_same_file(target, i) for i in inputs):
            raise OutputError(target, "is the input itself; it was not replaced", "Pass -o another path.")
        if target.exists() and not target.is_file():  # a device or a pipe: write into it, never replace it
            return write(target)
        if not folder.is_dir():
            raise OutputError(target, f"the folder {folder} does not exist", "Create it first, or pass -o elsewhere.")
        scratch = Path(tempfile.mkdtemp(prefix=".analyze-", dir=folder))
        try:
            for attempt in range(_FREE_NAME_ATTEMPTS):
                name = target.name if attempt == 0 else f"{target.stem}-{attempt}{target.suffix}"
                made = write(scratch / name)
                finals = [target if p.name == name else folder / p.relative_to(scratch) for p in made]
                links = [f for f in finals if f.is_symlink()]
                if default and links:
                    raise OutputError(links[0], "is a symbolic link where the report would go; it was not followed "
                                      "and nothing was written", "Remove the link, or pass -o a path of your own.")
                beside = [f for f in finals if f != target]
                if not any(os.path.lexists(f) or any(_same_file(f, i) for i in inputs) for f in beside):
                    break
                for p in made:
                    p.unlink()
            else:
                raise OutputError(target, f"every name tried for the files beside it is taken (up to "
                                  f"{target.stem}-{_FREE_NAME_ATTEMPTS - 1})", "Pass -o a path in another folder.")
            for made_path, final in zip(made, finals, strict=True):
                os.replace(made_path, final)
            return finals
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    except OSError as error:
        raise OutputError(target, f"the report cannot be written ({error.strerror or error})",
                          "Check the path, its permissions and the free space, or pass -o elsewhere.") from None


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _written(console: Console, what: str, path: Path) -> None:
    """A path printed as plain text (brackets in a folder's name are not markup, controls are shown escaped) and
    whole: never wrapped, so it can be copied and no line ends in the space before it."""
    console.print(Text(f"{what} ") + Text(printable(str(path)), style="bold"), soft_wrap=True)


def _summary(report: Report, console: Console) -> None:
    """The terminal summary, not even built when nothing would be printed (-q, JSON on stdout)."""
    if not console.quiet:
        from analyzer.report.text import print_summary

        print_summary(report, console)
