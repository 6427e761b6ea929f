"""Kineto reader against a bare ijson pass over the same large trace: wall time and peak RSS, side by side.

Builds (once) a trace of at least --min-mb megabytes by repeating the events of a real one
(../shared/real/hta/df_index_resolver.json.gz: 216k events, 28k [memory]) with times shifted by one window
per copy, into benchmarks/data/ (git-ignored). Then runs, each in a fresh interpreter, alternating, --rounds
times: (a) a bare `for event in ijson.items(f, "traceEvents.item")` with the C backend, the floor any
streaming reader pays; (b) `analyzer.ingest.load(path)`. Each child reports its wall time for the work
(imports excluded: pandas alone takes a second to import) and /usr/bin/time its peak RSS (imports included).
The best round of each is compared; targets: reader within 1.5x of bare ijson and under 0.5 GB RSS.

Run: python benchmarks/bench_kineto.py [--min-mb 500] [--rounds 2]
"""
from __future__ import annotations

import argparse
import gzip
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT.parent / "shared" / "real" / "hta" / "df_index_resolver.json.gz"
DATA = ROOT / "benchmarks" / "data"

# Each child imports what it needs, then times only the work; /usr/bin/time gives its peak RSS (ru_maxrss of a
# child forked from this process would include this process's pages from before the exec).
BARE = """
import sys, time
import ijson
backend = ijson.get_backend("yajl2_c")
start = time.perf_counter()
with open(sys.argv[1], "rb") as f:
    for _ in backend.items(f, "traceEvents.item", use_float=True):
        pass
print(time.perf_counter() - start)
"""
READER = """
import sys, time
from analyzer.ingest import load
start = time.perf_counter()
trace = load(sys.argv[1])
print(time.perf_counter() - start)
assert len(trace.allocations) > 0
"""


def build(target: Path, min_bytes: int) -> None:
    """Repeat the source window with shifted times until the file holds at least `min_bytes`."""
    with gzip.open(SOURCE, "rb") as f:
        data = json.load(f)
    events = data.pop("traceEvents")
    times = [e["ts"] for e in events if isinstance(e.get("ts"), (int, float))]
    window = max(times) - min(times) + 1
    tmp = target.with_suffix(".partial")
    with open(tmp, "w") as out:
        out.write(json.dumps(data)[:-1] + ', "traceEvents": [\n')
        copy, first = 0, True
        while first or out.tell() < min_bytes:
            for event in events:
                shifted = {**event, "ts": event["ts"] + copy * window} if "ts" in event else event
                out.write(("" if first else ",\n") + json.dumps(shifted))
                first = False
            copy += 1
        out.write("\n]}\n")
    tmp.rename(target)
    print(f"built {target} ({target.stat().st_size / 2**20:.0f} MiB, {copy} copies of {len(events):,} events)")


def measure(code: str, path: Path) -> tuple[float, int]:
    """(seconds of work, peak RSS bytes) of one fresh interpreter running `code` on `path`."""
    result = subprocess.run(["/usr/bin/time", "-f", "maxrss_kb=%M", sys.executable, "-c", code, str(path)], cwd=ROOT,
                            capture_output=True, text=True, check=True)
    rss_kb = int(result.stderr.rsplit("maxrss_kb=", 1)[1].split()[0])
    return float(result.stdout.split()[-1]), rss_kb * 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--min-mb", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    target = DATA / f"kineto_{args.min_mb}mb.json"
    if not target.exists():
        DATA.mkdir(parents=True, exist_ok=True)
        build(target, args.min_mb * 10**6)
    runs: dict[str, list[tuple[float, int]]] = {"bare ijson": [], "analyzer": []}
    for _ in range(args.rounds):
        runs["bare ijson"].append(measure(BARE, target))
        runs["analyzer"].append(measure(READER, target))
    best = {name: (min(s for s, _ in r), min(m for _, m in r)) for name, r in runs.items()}
    size_mb = target.stat().st_size / 10**6
    print(f"trace: {target.name}, {size_mb:.0f} MB")
    for name, (seconds, rss) in best.items():
        print(f"  {name:<11} {seconds:7.2f} s  {size_mb / seconds:6.1f} MB/s  peak RSS {rss / 2**20:7.0f} MiB")
    (bare_s, bare_rss), (ours_s, ours_rss) = best["bare ijson"], best["analyzer"]
    print(f"time ratio analyzer / bare ijson: {ours_s / bare_s:.2f}x (target <= 1.5x)")
    print(f"RSS ratio analyzer / bare ijson:  {ours_rss / bare_rss:.2f}x; analyzer {ours_rss / 2**30:.2f} GiB "
          "(target < 0.5 GB)")


if __name__ == "__main__":
    main()
