"""Regenerate fixtures/traces/sim/: one simulated snapshot and ground-truth sidecar per built-in scenario.

    python scripts/make_fixtures.py [NAME ...]

Deterministic (virtual clock, FakeTensorMode, no randomness reaches the allocator), so regenerating gives the
same files unless the tracer, the allocator model or the scenarios changed.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from analyzer.simulate.scenarios import SCENARIOS, generate  # noqa: E402

OUT = Path(__file__).resolve().parents[1] / "fixtures" / "traces" / "sim"
MAX_BYTES = 2 << 20


def main(names: list[str]) -> int:
    for name in names or list(SCENARIOS):
        path = OUT / f"{name}.pickle"
        simulation = generate(name, path)
        size = path.stat().st_size
        outcome = "out of memory" if simulation.oom else "no OOM"
        print(f"{path.relative_to(OUT.parents[2])}: {size / 1e6:.2f} MB, "
              f"{len(simulation.allocator.trace)} trace entries, {outcome}")
        if size >= MAX_BYTES:
            print(f"{name}: {size} bytes is over the 2 MiB fixture limit", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
