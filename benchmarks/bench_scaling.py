"""Issue 34's linearity check: `analyze FILE --format json` of the cpp-frames real-derived snapshot
(make_real_snapshot.py) at several sizes, each beside a bare pickle.load of the same file, in one run.

    python benchmarks/bench_scaling.py [--entries 1000000,2000000,3000000] [--repeats 2] [--case cpp-frames]

Prints, per size, the CPU seconds (user + system, os.wait4) of pickle.load and of the analysis (medians of the
interleaved repeats), their ratio, and the analysis's time over the smallest size's against the sizes' ratio: the
issue asks 5M entries to take at most 5.5x the 1M time. The files are built into benchmarks/data/ (bench_real.build).
"""
from __future__ import annotations

import argparse

from bench_real import build, commands
from measure import compare


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--entries", default="1000000,2000000,3000000")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--case", default="cpp-frames")
    args = parser.parse_args()
    sizes = [int(n) for n in args.entries.split(",")]
    first: float | None = None
    print(f"{'entries':>10} {'MiB':>5} {'pickle.load CPU s':>18} {'JSON CPU s':>11} {'ratio':>6} {'peak RSS ratio':>15} "
          f"{'JSON / first':>13} {'size / first':>13}")
    for entries in sizes:
        path = build(args.case, entries)
        wanted = {k: v for k, v in commands(path).items() if "html" not in k}
        runs = compare(wanted, args.repeats)
        load, json = runs["pickle.load (baseline)"], runs["analyze FILE --format json"]
        first = first if first is not None else json.cpu_seconds
        print(f"{entries:>10,} {path.stat().st_size / 2**20:>5.0f} {load.cpu_seconds:>18.2f} {json.cpu_seconds:>11.2f} "
              f"{json.cpu_seconds / load.cpu_seconds:>5.2f}x {json.peak_rss_mib / load.peak_rss_mib:>14.2f}x "
              f"{json.cpu_seconds / first:>12.2f}x {entries / sizes[0]:>12.2f}x", flush=True)


if __name__ == "__main__":
    main()
