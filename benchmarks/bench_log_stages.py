"""Issue 31 benchmark, in-process: where a large log's read goes, stage by stage, and the searches for the
anchors compared on the same blocks (CPU s, best of N). Each Scan stage is the reading, the search and the
line count (C) and the Python of the matched lines: every one decoded and cleaned; the Megatron lines taken
from their bytes (no Reading built); the same lines only matched and counted, as past MAX_READINGS. read_log
adds the readers and the Readings built:

    python benchmarks/bench_log_stages.py [--megabytes 200] [--repeats 5]

Reads benchmarks/data/train_<N>MB.log (bench_log.py makes it). pyahocorasick is measured where it is installed
(`pip install pyahocorasick==2.1.0`; not a dependency: it was slower than the search it would replace).
"""
from __future__ import annotations

import argparse
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from bench_log import DATA, make_log

from analyzer.ingest.log import ANCHORS, read_log_file
from analyzer.ingest.log.framework_lines import QUICK
from analyzer.ingest.log.lines import Quick, Scan, _ends_one_by_one, _newlines, line_finder


def best(run: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.process_time()
        run()
        times.append(time.process_time() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--megabytes", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    path = DATA / f"train_{args.megabytes}MB.log"
    if not path.exists():
        DATA.mkdir(exist_ok=True)
        make_log(path, args.megabytes)

    def blocks() -> Iterator[bytes]:
        with open(path, "rb") as f:
            while block := f.read(1 << 20):
                yield block

    def read_into() -> int:
        buffer = bytearray(1 << 20)
        view, size = memoryview(buffer), 0
        with open(path, "rb") as f:
            while got := f.readinto(view):
                size += got
        return size

    regions = [b[: b.rfind(b"\n") + 1] for b in blocks()]   # whole lines, as Scan hands them to the search
    alternatives = re.compile(b"|".join(map(re.escape, ANCHORS)))
    hyperscan_ends = line_finder(ANCHORS)

    def scan(quick: Quick | None) -> Callable[[], None]:
        def run() -> None:
            with open(path, "rb") as f:
                for _ in Scan(f, ANCHORS, lambda: False, quick):
                    pass
        return run

    stages: dict[str, Callable[[], object]] = {
        "read in 1 MiB blocks": lambda: sum(map(len, blocks())),
        "read into one 1 MiB buffer": read_into,
        "search: 7 bytes.find passes": lambda: [_ends_one_by_one(r, ANCHORS, len(r)) for r in regions],
        "search: one re of the alternatives": lambda: [alternatives.findall(r) for r in regions],
        "search: line_finder (Hyperscan if installed)": lambda: [hyperscan_ends(r, len(r)) for r in regions],
        "count lines: bytes.count": lambda: [r.count(b"\n") for r in regions],
        "count lines: bytes.replace (_newlines)": lambda: [_newlines(r) for r in regions],
        "Scan, every matched line decoded and cleaned": scan(None),
        "Scan, Megatron lines taken from their bytes": scan(Quick(QUICK, lambda number, match: True)),
        "Scan, Megatron lines only matched (past the cap)": scan(Quick(QUICK, lambda number, match: False)),
        "read_log (Scan and every reader)": lambda: read_log_file(path),
    }
    try:
        import ahocorasick
    except ImportError:
        pass
    else:
        automaton = ahocorasick.Automaton()
        for anchor in ANCHORS:
            automaton.add_word(anchor.decode(), anchor.decode())
        automaton.make_automaton()
        stages["search: pyahocorasick (latin-1 str)"] = \
            lambda: [list(automaton.iter(r.decode("latin-1"))) for r in regions]
    print(f"{Path(path).name}: {path.stat().st_size / 2**20:.0f} MiB, CPU s best of {args.repeats}")
    for name, run in stages.items():
        print(f"{name:48} {best(run, args.repeats):8.3f}")


if __name__ == "__main__":
    main()
