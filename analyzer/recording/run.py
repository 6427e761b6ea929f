"""The child side of `analyze run`: `python -m analyzer.recording.run (script.py | -m module) ARGS`.

Runs the script as `__main__` inside a `Capture` on $ANALYZER_CAPTURE_DIR that counts a step at every optimizer
step, so the script needs no change and an OOM that escapes it is dumped before the process ends. Launchers
that `analyze run` cannot rewrite start it themselves: `torchrun --nproc-per-node 8 -m analyzer.recording.run
train.py ARGS`.
"""
from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

from analyzer.recording.session import Capture

ENV_DIR = "ANALYZER_CAPTURE_DIR"


def run_under_capture(argv: list[str]) -> None:
    """Run `script.py ARGS` or `-m module ARGS` as `__main__` inside a Capture on ANALYZER_CAPTURE_DIR."""
    if not argv or (argv[0] == "-m" and len(argv) < 2):
        sys.exit(f"usage: {ENV_DIR}=DIR python -m analyzer.recording.run (script.py | -m module) [ARGS]")
    with Capture(os.environ.get(ENV_DIR, "memory_capture"), count_optimizer_steps=True):
        if argv[0] == "-m":
            sys.argv = argv[1:]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = argv
            sys.path[0] = str(Path(argv[0]).resolve().parent)  # as `python script.py` would have it
            runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    run_under_capture(sys.argv[1:])
