"""The `analyze` command line: `analyze FILE ...` analyses a recording; `analyze NAME ...` runs a subcommand.

Every command is a small object with `prepare_parser(parser)` and `run(args) -> exit code` (the `Command`
protocol), registered by name in `COMMANDS` and imported only when used, so `analyze FILE` never imports
what `simulate` or `run` need (torch). Errors map to exit codes here, once: bad input is one line on stderr and
exit code 2; an unexpected error is a bug of ours: one line, exit code 1, and the traceback only with
ANALYZER_DEBUG=1.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback
from typing import Protocol

from analyzer.core.printable import printable
from analyzer.errors import EXIT_BAD_INPUT, AnalyzerError

EXIT_INTERNAL = 1
EXIT_INTERRUPTED = 130


class Command(Protocol):
    """One command: what it says in --help, its arguments, and what it does with them."""

    description: str

    def prepare_parser(self, parser: argparse.ArgumentParser) -> None: ...

    def run(self, args: argparse.Namespace) -> int: ...


#: `analyze NAME ...` -> "module:CommandClass"
COMMANDS: dict[str, str] = {
    "check": "analyzer.commands.check:CheckCommand",
    "diff": "analyzer.commands.diff:DiffCommand",
    "estimate": "analyzer.commands.estimate:EstimateCommand",
    "log": "analyzer.commands.log:LogCommand",
    "simulate": "analyzer.commands.simulate:SimulateCommand",
    "run": "analyzer.commands.run:RunCommand",
}
#: `analyze FILE ...`: the command when the first argument names no subcommand
DEFAULT = "analyzer.commands.analyze:AnalyzeCommand"


def command(name: str | None) -> Command:
    """The command registered as `name` (None: the analysis of a file)."""
    module, cls = (COMMANDS[name] if name else DEFAULT).split(":")
    made: Command = getattr(importlib.import_module(module), cls)()
    return made


def parser_for(name: str | None, cmd: Command) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"analyze {name}" if name else "analyze", description=cmd.description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    cmd.prepare_parser(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        name = argv[0] if argv and argv[0] in COMMANDS else None
        cmd = command(name)
        args = parser_for(name, cmd).parse_args(argv[1:] if name else argv)
        return cmd.run(args)
    except AnalyzerError as error:
        print(f"analyze: error: {printable(str(error))}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("analyze: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        return 0
    except Exception as error:  # a bug of ours: one line, never a traceback unless asked for
        if os.environ.get("ANALYZER_DEBUG"):
            traceback.print_exc()
        print(f"analyze: internal error: {type(error).__name__}: {printable(str(error))}. Please report it with the input "
              "(set ANALYZER_DEBUG=1 for the traceback).", file=sys.stderr)
        return EXIT_INTERNAL
