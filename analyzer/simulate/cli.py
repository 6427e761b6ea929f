"""`analyze simulate`: write a simulated snapshot from a built-in scenario or from the user's training functions.

    simulate --list
    simulate --scenario fragmentation [-o out.pickle]
    simulate train_fns.py --gpu-memory 24GiB [--steps 3] [--expandable-segments] [--fake] -o out.pickle

A user file defines `model_fn()`, `batch_fn(step)` and `optimizer_fn(params)`, and optionally
`loss_fn(output, targets)` and `save_fn(model, optimizer)`; see `analyzer.simulate.runner`.
"""
from __future__ import annotations

import argparse
import re
import runpy
import sys
from pathlib import Path

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}
_REQUIRED = ("model_fn", "batch_fn", "optimizer_fn")


def parse_size(text: str) -> int:
    """'24GiB', '80GB', '512MiB' or a number of bytes."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGT]i?B|B)?\s*", text, re.IGNORECASE)
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 24GiB, 80GB or a number of bytes)")
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "").upper()])


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="analyze simulate", description=__doc__.split("\n")[0])
    parser.add_argument("file", nargs="?", type=Path, help="python file defining model_fn, batch_fn, optimizer_fn")
    parser.add_argument("--scenario", help="a built-in scenario instead of a file (see --list)")
    parser.add_argument("--list", action="store_true", help="list the built-in scenarios")
    parser.add_argument("-o", "--out", type=Path, help="snapshot to write (default: <scenario>.pickle)")
    parser.add_argument("--gpu-memory", type=parse_size, help="device capacity, e.g. 24GiB (files only)")
    parser.add_argument("--steps", type=int, default=3, help="training steps to trace (default 3)")
    parser.add_argument("--expandable-segments", action="store_true", help="simulate expandable_segments:True")
    parser.add_argument("--fake", action="store_true", help="trace under FakeTensorMode (no memory used)")
    return parser


def simulate_command(argv: list[str]) -> int:
    """Run the command; 0 on success, 2 on a usage error."""
    parser = _parser()
    args = parser.parse_args(argv)
    from analyzer.simulate.scenarios import SCENARIOS, generate

    if args.list:
        for name, scenario in SCENARIOS.items():
            print(f"{name:22} {scenario.claim}")
        return 0
    if args.scenario:
        if args.scenario not in SCENARIOS:
            print(f"analyze simulate: unknown scenario {args.scenario!r}; one of: {', '.join(SCENARIOS)}", file=sys.stderr)
            return 2
        out = args.out or Path(f"{args.scenario}.pickle")
        simulation = generate(args.scenario, out)
    elif args.file:
        if args.gpu_memory is None or args.out is None:
            print("analyze simulate: a file needs --gpu-memory and -o", file=sys.stderr)
            return 2
        namespace = runpy.run_path(str(args.file))
        missing = [name for name in _REQUIRED if not callable(namespace.get(name))]
        if missing:
            print(f"analyze simulate: {args.file} does not define {', '.join(missing)}", file=sys.stderr)
            return 2
        from analyzer.simulate.runner import run

        out = args.out
        simulation = run(namespace["model_fn"], namespace["batch_fn"], namespace["optimizer_fn"],
                         gpu_memory=args.gpu_memory, out=out, steps=args.steps, loss_fn=namespace.get("loss_fn"),
                         save_fn=namespace.get("save_fn"), expandable_segments=args.expandable_segments,
                         fake=args.fake)
    else:
        parser.print_usage(sys.stderr)
        return 2
    outcome = (f"out of memory in {simulation.oom.phase} of step {simulation.oom.step}" if simulation.oom
               else "no out-of-memory")
    print(f"wrote {out} ({len(simulation.allocator.trace)} trace entries, {outcome}) and its .truth.json")
    return 0
