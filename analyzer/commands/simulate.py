"""`analyze simulate`: write a simulated snapshot from a built-in scenario or from the user's training functions,
then analyse it as a real snapshot (the predicted peak, the OOM if the step does not fit, what to change).

    simulate --list
    simulate --scenario fragmentation [-o out.pickle] [--stacks all]
    simulate train_fns.py --gpu-memory 24GiB [--steps 3] [--expandable-segments] [--fake] -o out.pickle

A user file defines `model_fn()`, `batch_fn(step)` and `optimizer_fn(params)`, and optionally
`loss_fn(output, targets)` and `save_fn(model, optimizer)`; see `analyzer.simulate.runner`.
"""
from __future__ import annotations

import argparse
import runpy
import sys
from pathlib import Path

from analyzer.core.units import parse_bytes
from analyzer.errors import user_code_error

_REQUIRED = ("model_fn", "batch_fn", "optimizer_fn")


USAGE = "analyze simulate (--list | --scenario NAME [-o OUT] | FILE --gpu-memory SIZE -o OUT) [options]"


class SimulateCommand:
    description = __doc__

    def prepare_parser(self, parser: argparse.ArgumentParser) -> None:
        parser.usage = USAGE
        parser.add_argument("file", nargs="?", type=Path, help="python file defining model_fn, batch_fn, optimizer_fn")
        parser.add_argument("--scenario", help="a built-in scenario instead of a file (see --list)")
        parser.add_argument("--list", action="store_true", help="list the built-in scenarios")
        parser.add_argument("-o", "--out", type=Path, help="snapshot to write (default: <scenario>.pickle)")
        parser.add_argument("--gpu-memory", type=parse_bytes, help="device capacity, e.g. 24GiB (files only)")
        parser.add_argument("--steps", type=int, default=3, help="training steps to trace (default 3)")
        parser.add_argument("--expandable-segments", action="store_true", help="simulate expandable_segments:True")
        parser.add_argument("--fake", action="store_true", help="trace under FakeTensorMode (no memory used)")
        parser.add_argument("--stacks", choices=("python", "all"), default="python",
                            help="frames recorded as _record_memory_history(stacks=...) would: Python only, or "
                                 "C++ and CPython frames interleaved with them (default python)")
        parser.add_argument("--no-analysis", action="store_true", help="only write the snapshot")

    def run(self, args: argparse.Namespace) -> int:
        """0 on success, 2 on a usage error."""
        from analyzer.simulate.scenarios import ALL_SCENARIOS, generate

        if args.list:
            for name, scenario in ALL_SCENARIOS.items():
                print(f"{name:22} {scenario.claim}")
            return 0
        if args.scenario:
            if args.scenario not in ALL_SCENARIOS:
                print(f"analyze simulate: unknown scenario {args.scenario!r}; one of: {', '.join(ALL_SCENARIOS)}",
                      file=sys.stderr)
                return 2
            out = args.out or Path(f"{args.scenario}.pickle")
            try:
                simulation = generate(args.scenario, out, stacks=args.stacks)
            except ModuleNotFoundError as error:
                print(f"analyze simulate: {error}", file=sys.stderr)
                return 2
        elif args.file:
            if args.gpu_memory is None or args.out is None:
                print("analyze simulate: a file needs --gpu-memory and -o", file=sys.stderr)
                return 2
            try:
                namespace = runpy.run_path(str(args.file))
            except Exception as error:
                raise (user_code_error(error, args.file) or error) from None
            missing = [name for name in _REQUIRED if not callable(namespace.get(name))]
            if missing:
                print(f"analyze simulate: {args.file} does not define {', '.join(missing)}", file=sys.stderr)
                return 2
            from analyzer.simulate.runner import run

            out = args.out
            try:
                simulation = run(namespace["model_fn"], namespace["batch_fn"], namespace["optimizer_fn"],
                                 gpu_memory=args.gpu_memory, out=out, steps=args.steps, loss_fn=namespace.get("loss_fn"),
                                 save_fn=namespace.get("save_fn"), expandable_segments=args.expandable_segments,
                                 fake=args.fake, stacks=args.stacks)
            except Exception as error:  # the user's model raising is their bug, one line; one of ours is reported
                raise (user_code_error(error, args.file) or error) from None
        else:
            print(f"usage: {USAGE}", file=sys.stderr)
            return 2
        outcome = (f"out of memory in {simulation.oom.phase} of step {simulation.oom.step}" if simulation.oom
                   else "no out-of-memory")
        print(f"wrote {out} ({len(simulation.allocator.trace)} trace entries, {outcome}) and its .truth.json")
        if args.no_analysis:
            return 0
        from analyzer.commands import main

        capacity = ["--gpu-memory", str(simulation.allocator.device.capacity)] if simulation.allocator.device.capacity else []
        return main([str(out), *capacity])
