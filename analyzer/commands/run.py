"""`analyze run [--out DIR] -- python train.py ARGS`: record an unmodified script, then analyse the recording.

The parent (`RunCommand`) starts the command in a child process with ANALYZER_CAPTURE_DIR set. A Python
command (`python [options] script.py ARGS` or `python [options] -m module ARGS`) is started as
`python [options] -m analyzer.recording.run script.py ARGS`, which records the script under a `Capture`.
Any other command (torchrun, a shell wrapper) runs as given; it records if it starts Python through that
module itself, e.g. `torchrun --nproc-per-node 8 -m analyzer.recording.run train.py ARGS`.

Afterwards every recording the run wrote is analysed with the ordinary `analyze FILE` command; the exit code
is the child's when it failed, else the analyses' worst.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from analyzer.errors import AnalyzerError
from analyzer.recording.run import ENV_DIR

RECORDINGS = ("rank*.pickle", "rank*_trace.json.gz")
_PYTHON = re.compile(r"^python(\d+(\.\d+)*)?(\.exe)?$")
_OPTIONS_WITH_VALUE = frozenset({"-W", "-X", "--check-hash-based-pycs"})
_USAGE = "analyze run [--out DIR] -- python train.py ARGS"


class RunCommand:
    description = ("Run a training script unmodified with memory capture on (CUDA memory history with Python "
                   "stacks, snapshots at optimizer steps 1 and 3, at exit and on out-of-memory; a profiler trace "
                   "of host memory without CUDA), then analyse what it recorded.")

    def prepare_parser(self, parser: argparse.ArgumentParser) -> None:
        parser.usage = _USAGE
        parser.add_argument("--out", type=Path, help="folder for the recordings and reports "
                                                     "(default: ./analyze-run-YYYYmmdd-HHMMSS)")
        parser.add_argument("command", nargs=argparse.REMAINDER, help="the command to run, after --")

    def run(self, args: argparse.Namespace) -> int:
        """Run the command under capture, then `analyze` each recording it wrote."""
        command = args.command[1:] if args.command[:1] == ["--"] else args.command
        if not command:
            raise AnalyzerError(None, "no command to run", f"Usage: {_USAGE}")
        out = (args.out or Path(time.strftime("analyze-run-%Y%m%d-%H%M%S"))).resolve()
        out.mkdir(parents=True, exist_ok=True)
        started = time.time()
        returncode = _run(child_command(command), {**os.environ, ENV_DIR: str(out)})
        recordings = new_recordings(out, started)
        if not recordings:
            print(f"analyze run: the command wrote no recording to {out}. Only `python script.py ...` and "
                  f"`python -m module ...` are started under capture; for other launchers run Python through "
                  f"`-m analyzer.recording.run` (torchrun ... -m analyzer.recording.run train.py ARGS) "
                  f"with {ENV_DIR}={out}.",
                  file=sys.stderr)
            return returncode or 2
        return returncode or max(_analyze(path) for path in recordings)


def child_command(command: list[str]) -> list[str]:
    """The command with `-m analyzer.recording.run` put before the script or `-m module` of a Python command
    (its interpreter options kept); any other command, or Python with `-c` or stdin, is returned as it is."""
    if not _PYTHON.match(Path(command[0]).name):
        return command
    i = 1
    while i < len(command) and command[i].startswith("-") and command[i] not in ("-m", "-c", "-"):
        i += 2 if command[i] in _OPTIONS_WITH_VALUE else 1
    if i >= len(command) or command[i] in ("-c", "-"):
        return command
    return [*command[:i], "-m", "analyzer.recording.run", *command[i:]]


def _run(command: list[str], env: dict[str, str]) -> int:
    try:
        child = subprocess.Popen(command, env=env)
    except OSError as error:
        raise AnalyzerError(command[0], f"cannot start the command ({error.strerror or error})",
                            f"Usage: {_USAGE}") from None
    with child:
        try:
            return child.wait()
        except KeyboardInterrupt:  # the child got the same Ctrl-C: let it write its recording on the way out
            return child.wait()


def new_recordings(folder: Path, since: float) -> list[Path]:
    """Recordings in `folder` written since `since` (an earlier run's files in the same folder are left)."""
    found = {p for pattern in RECORDINGS for p in folder.glob(pattern) if p.stat().st_mtime >= since - 1}
    return sorted(found)


def _analyze(path: Path) -> int:
    from analyzer.commands import main

    print(f"\n== analyze {path}", flush=True)
    return main([str(path)])

