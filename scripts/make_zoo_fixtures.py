"""Regenerate fixtures/traces/zoo/: per zoo case (analyzer/simulate/zoo.py), a simulated snapshot with Python
frames only (`<case>.pickle`) and one with C++ and CPython frames interleaved as `stacks="all"` records them
(`<case>.all.pickle`), each with its ground-truth sidecar (`.truth.json`).

    python scripts/make_zoo_fixtures.py [NAME ...]

Needs transformers and peft (the `test` extra). Deterministic: seeded weights and batches, a virtual clock.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from analyzer.simulate.scenarios import ZOO_SCENARIOS, generate  # noqa: E402

OUT = Path(__file__).resolve().parents[1] / "fixtures" / "traces" / "zoo"
MAX_BYTES = 1_500_000


def main(names: list[str]) -> int:
    for name in names or list(ZOO_SCENARIOS):
        for stacks, path in (("python", OUT / f"{name}.pickle"), ("all", OUT / f"{name}.all.pickle")):
            start = time.perf_counter()
            simulation = generate(name, path, stacks=stacks)
            sizes = [path.stat().st_size, path.with_name(path.stem + ".truth.json").stat().st_size]
            print(f"{path.relative_to(OUT.parents[2])}: {sizes[0] / 1e6:.2f} MB (truth {sizes[1] / 1e6:.2f} MB), "
                  f"{len(simulation.allocator.trace)} trace entries, {time.perf_counter() - start:.1f} s")
            if max(sizes) >= MAX_BYTES:
                print(f"{name}: {max(sizes)} bytes is over the {MAX_BYTES} byte fixture limit", file=sys.stderr)
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
