"""Kineto reader against a bare ijson pass and HTA's TraceAnalysis over the same large trace: wall time and peak
RSS, side by side in one run.

Builds (once) a trace of at least --min-mb megabytes by repeating the events of a real one
(../shared/real/hta/df_index_resolver.json.gz: 216k events, 28k [memory]) into benchmarks/data/ (git-ignored).
Each copy is shifted by one window in time and keeps unique the ids a real long trace numbers uniquely
(correlation, External id, Ev Idx, flow ids, Python ids, the N of ProfilerStep#N): repeated ids would make
HTA's join of kernels to their launches on `correlation` grow with the square of the copies, a cost of the
repetition rather than of HTA. Then runs, each in a fresh interpreter, interleaved --rounds times through
benchmarks/measure.compare (median wall time and peak RSS of the child process, from os.wait4):
(a) a bare `for event in ijson.items(f, "traceEvents.item")` with the C backend, the floor any streaming
reader pays; (b) `analyzer.ingest.load(path)`; (c) HTA's `TraceAnalysis(trace_dir=...)` on a directory holding
a link to the trace (HTA takes one trace per rank from a directory), cut off after --hta-timeout seconds.
The process wall time includes interpreter start and imports (pandas alone takes about a second); each child
also reports the time of its work alone, imports excluded, printed beside it.

HolisticTraceAnalysis is not a dependency of the analyzer: without it (`pip install HolisticTraceAnalysis`;
0.5.0 also imports psutil, which it does not declare) its column is skipped with the reason printed.

Before the timing, one child loads the original trace with HTA and reports what HTA keeps of it: `[memory]`
events in HTA's DataFrame against the raw file, profiler steps, and the op it finds at the allocation peak.

Run: python benchmarks/bench_kineto.py [--min-mb 500] [--rounds 3] [--hta-timeout 1200]
"""
from __future__ import annotations

import argparse
import gzip
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).resolve().parent))
import measure  # noqa: E402  (benchmarks/measure.py: wall time and peak RSS per child, interleaved repeats)

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT.parent / "shared" / "real" / "hta" / "df_index_resolver.json.gz"
DATA = ROOT / "benchmarks" / "data"
ID_ARGS = ("correlation", "External id", "Ev Idx", "Python id", "Python parent id")
STEP = re.compile(r"^ProfilerStep#(\d+)$")

# Each child imports what it needs, times only the work and appends that time to the file argv[2]; the process
# as a whole (start, imports, work) is timed, and its peak RSS taken, by measure.measure.
BARE = """
import sys, time
import ijson
backend = ijson.get_backend("yajl2_c")
start = time.perf_counter()
with open(sys.argv[1], "rb") as f:
    for _ in backend.items(f, "traceEvents.item", use_float=True):
        pass
seconds = time.perf_counter() - start
open(sys.argv[2], "a").write(f"{seconds}\\n")
"""
READER = """
import sys, time
from analyzer.ingest import load
start = time.perf_counter()
trace = load(sys.argv[1])
seconds = time.perf_counter() - start
assert len(trace.allocations) > 0
open(sys.argv[2], "a").write(f"{seconds}\\n")
"""
# argv: trace directory, time file, timeout seconds. On timeout the child records it and exits 0 so that the
# other columns' rounds go on; SIGALRM is handled between bytecodes (after a C call under way, e.g. json.loads).
HTA = """
import logging, os, signal, sys, time, warnings
warnings.simplefilter("ignore")
from hta.trace_analysis import TraceAnalysis
logging.getLogger("hta").setLevel(logging.ERROR)
def give_up(*_):
    open(sys.argv[2], "a").write("timeout\\n")
    os._exit(0)
signal.signal(signal.SIGALRM, give_up)
signal.alarm(int(sys.argv[3]))
start = time.perf_counter()
analysis = TraceAnalysis(trace_dir=sys.argv[1])
seconds = time.perf_counter() - start
signal.alarm(0)
assert sum(len(df) for df in analysis.t.get_all_traces().values()) > 0
open(sys.argv[2], "a").write(f"{seconds}\\n")
"""
IMPORT_HTA = "import logging; logging.disable(); from hta.trace_analysis import TraceAnalysis"

# What HTA keeps of a trace, printed as one JSON line. argv: trace (.json.gz), an empty scratch directory.
COVERAGE = """
import gzip, json, logging, os, sys, time, warnings
warnings.simplefilter("ignore")
from hta.common.trace import parse_trace_file
from hta.trace_analysis import TraceAnalysis
logging.getLogger("hta").setLevel(logging.ERROR)

source, scratch = sys.argv[1], sys.argv[2]
with gzip.open(source, "rb") as f:
    events = json.load(f)["traceEvents"]
memory = [e for e in events if e.get("name") == "[memory]"]
gpu = [e for e in memory if e.get("args", {}).get("Device Type") == 1]
peak = max(gpu, key=lambda e: e["args"]["Total Allocated"])
# the innermost cpu_op containing the peak event on its thread, from the raw events
ops = [e for e in events if e.get("cat") == "cpu_op" and e["tid"] == peak["tid"]
       and e["ts"] <= peak["ts"] < e["ts"] + e["dur"]]
raw_op = min(ops, key=lambda e: e["dur"])["name"] if ops else None

def memory_rows(frame, symbols):
    ids = [symbols[s] for s in ("[memory]", "cpu_instant_event") if s in symbols]
    return int((frame["name"].isin(ids) | frame["cat"].isin(ids)).sum())

_, parsed, local = parse_trace_file(source)      # HTA's parse of one file, before its step filtering
os.symlink(source, os.path.join(scratch, os.path.basename(source)))
start = time.perf_counter()
analysis = TraceAnalysis(trace_dir=scratch)
load_s = time.perf_counter() - start
rank = analysis.t.get_ranks()[0]
df = analysis.t.get_trace(rank)
symbols = analysis.t.symbol_table.get_sym_id_map()
names = analysis.t.symbol_table.get_sym_table()
# the op at the peak through HTA: its ts are the trace's minus t.min_ts (its "end" column is not shifted, so
# ts + dur is the end)
ts = peak["ts"] - analysis.t.min_ts
cpu = df[(df["cat"] == symbols.get("cpu_op", -2)) & (df["tid"] == peak["tid"]) & (df["ts"] <= ts)
         & (ts < df["ts"] + df["dur"])]
hta_op = names[int(cpu.loc[cpu["dur"].idxmin(), "name"])] if len(cpu) else None
print(json.dumps({
    "raw_events": len(events), "raw_memory": len(memory),
    "parsed_rows": len(parsed), "parsed_memory": memory_rows(parsed, local.get_sym_id_map()),
    "hta_rows": len(df), "hta_memory": memory_rows(df, symbols), "hta_load_s": load_s,
    "memory_arg_columns": sorted(set(df.columns) & {"Addr", "Bytes", "Total Allocated", "Total Reserved",
                                                     "Device Type", "Device Id"}),
    "steps_in_trace": len({e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")}),
    "hta_iterations": [int(i) for i in analysis.t.get_iterations(rank)],
    "peak_allocated": peak["args"]["Total Allocated"], "raw_op_at_peak": raw_op, "hta_op_at_peak": hta_op,
}))
"""


def build(target: Path, min_bytes: int) -> None:
    """Repeat the source window with shifted times and ids until the file holds at least `min_bytes`."""
    with gzip.open(SOURCE, "rb") as f:
        data = json.load(f)
    events = data.pop("traceEvents")
    times = [e["ts"] for e in events if isinstance(e.get("ts"), (int, float))]
    window = max(times) - min(times) + 1
    ids = [e["id"] for e in events if isinstance(e.get("id"), int)]
    ids += [v for e in events for k, v in e.get("args", {}).items() if k in ID_ARGS and isinstance(v, int)]
    id_span = max(ids) + 1
    steps = [int(m.group(1)) for e in events if (m := STEP.match(str(e.get("name", ""))))]
    step_span = max(steps) - min(steps) + 1 if steps else 0

    def shifted(event: dict, copy: int) -> dict:
        if copy == 0:
            return event
        event = dict(event)
        if isinstance(event.get("ts"), (int, float)):
            event["ts"] += copy * window
        if isinstance(event.get("id"), int):
            event["id"] += copy * id_span
        if (m := STEP.match(str(event.get("name", "")))):
            event["name"] = f"ProfilerStep#{int(m.group(1)) + copy * step_span}"
        args = event.get("args")
        if args and any(k in args for k in ID_ARGS):
            event["args"] = {k: v + copy * id_span if k in ID_ARGS and isinstance(v, int) and v >= 0 else v
                             for k, v in args.items()}
        return event

    tmp = target.with_suffix(".partial")
    with open(tmp, "w") as out:
        out.write(json.dumps(data)[:-1] + ', "traceEvents": [\n')
        copy, first = 0, True
        while first or out.tell() < min_bytes:
            for event in events:
                out.write(("" if first else ",\n") + json.dumps(shifted(event, copy)))
                first = False
            copy += 1
        out.write("\n]}\n")
    tmp.rename(target)
    print(f"built {target} ({target.stat().st_size / 2**20:.0f} MiB, {copy} copies of {len(events):,} events)")


def hta_unavailable() -> str | None:
    """Why HTA cannot be imported here, or None when it can."""
    result = subprocess.run([sys.executable, "-c", IMPORT_HTA], capture_output=True, text=True)
    if result.returncode == 0:
        return None
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    return lines[-1] if lines else f"exit status {result.returncode}"


def coverage() -> dict:
    """What HTA keeps of the original trace (see COVERAGE)."""
    with tempfile.TemporaryDirectory() as scratch:
        result = subprocess.run([sys.executable, "-c", COVERAGE, str(SOURCE), scratch], cwd=ROOT,
                                capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def print_coverage(c: dict) -> None:
    print(f"HTA on {SOURCE.name} (the original, {SOURCE.stat().st_size / 10**6:.1f} MB gzip):")
    print(f"  [memory] events: raw file {c['raw_memory']:,} of {c['raw_events']:,} events; "
          f"HTA's parse {c['parsed_memory']:,} of {c['parsed_rows']:,} rows; "
          f"TraceAnalysis DataFrame {c['hta_memory']:,} of {c['hta_rows']:,} rows "
          f"(memory arg columns kept: {c['memory_arg_columns'] or 'none'})")
    print(f"  TraceAnalysis load: {c['hta_load_s']:.2f} s; profiler steps in the trace {c['steps_in_trace']}, "
          f"HTA iterations {c['hta_iterations']}")
    print(f"  op at the allocation peak ({c['peak_allocated'] / 2**30:.2f} GiB): raw cpu_op {c['raw_op_at_peak']!r}, "
          f"through HTA {c['hta_op_at_peak']!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--min-mb", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--hta-timeout", type=int, default=1200, help="seconds before one HTA load is given up")
    parser.add_argument("--build-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    target = DATA / f"kineto_{args.min_mb}mb_v2.json"   # v2: ids and step numbers shifted per copy too
    if args.build_only:
        DATA.mkdir(parents=True, exist_ok=True)
        build(target, args.min_mb * 10**6)
        return
    if not target.exists():
        # Built in a child: a child's ru_maxrss starts from the RSS its parent had when it forked (Linux carries
        # the pre-exec high-water mark over), so this process must stay small to leave the children's peaks clean.
        subprocess.run([sys.executable, __file__, "--min-mb", str(args.min_mb), "--build-only"], check=True)

    hta_missing = hta_unavailable()
    if hta_missing:
        print(f"HTA column skipped: cannot import hta.trace_analysis ({hta_missing})")
    else:
        print_coverage(coverage())
        rank_dir = DATA / "hta_rank"                       # HTA reads every .json/.json.gz of a directory
        rank_dir.mkdir(exist_ok=True)
        for old in rank_dir.iterdir():
            old.unlink()
        (rank_dir / target.name).symlink_to(target)

    times = DATA / "times"
    times.mkdir(exist_ok=True)
    commands = {"bare ijson (C backend)": [sys.executable, "-c", BARE, str(target)],
                "analyzer.load": [sys.executable, "-c", READER, str(target)]}
    if not hta_missing:
        commands["HTA TraceAnalysis"] = [sys.executable, "-c", HTA, str(DATA / "hta_rank")]
    work: dict[str, Path] = {}
    for i, (name, command) in enumerate(commands.items()):
        work[name] = times / f"{i}.txt"
        work[name].write_text("")
        command.append(str(work[name]))
    if not hta_missing:
        commands["HTA TraceAnalysis"].append(str(args.hta_timeout))

    size_mb = target.stat().st_size / 10**6
    print(f"trace: {target.name}, {size_mb:.0f} MB; {args.rounds} interleaved rounds, medians")
    results = measure.compare(commands, args.rounds)
    work_s: dict[str, float | None] = {}
    for name, file in work.items():
        lines = file.read_text().split()
        timed_out = len(lines) - len([x for x in lines if x != "timeout"])
        work_s[name] = None if timed_out else median(float(x) for x in lines)
        if timed_out:
            print(f"  {name}: {timed_out} of {len(lines)} runs timed out after {args.hta_timeout} s")

    print(f"{'tool':<24} {'wall s':>8} {'work s':>8} {'MB/s':>7} {'peak RSS MiB':>13}")
    for name, r in results.items():
        w = work_s[name]
        print(f"{name:<24} {r.seconds:>8.2f} {'timeout' if w is None else f'{w:.2f}':>8} "
              f"{size_mb / r.seconds:>7.1f} {r.peak_rss_mib:>13.0f}")
    ours, bare = results["analyzer.load"], results["bare ijson (C backend)"]
    ours_w, bare_w = work_s["analyzer.load"], work_s["bare ijson (C backend)"]
    print(f"analyzer / bare ijson: wall {ours.seconds / bare.seconds:.2f}x, work {ours_w / bare_w:.2f}x "
          f"(target <= 1.5x); analyzer peak RSS {ours.peak_rss_mib * 2**20 / 10**9:.2f} GB (target < 0.5 GB)")
    if not hta_missing:
        hta, hta_w = results["HTA TraceAnalysis"], work_s["HTA TraceAnalysis"]
        if hta_w is None:
            print(f"HTA timed out: analyzer at least {hta.seconds / ours.seconds:.1f}x faster (wall)")
        else:
            print(f"HTA / analyzer: wall {hta.seconds / ours.seconds:.2f}x, work {hta_w / ours_w:.2f}x "
                  f"(target >= 4x); peak RSS {hta.peak_rss_mib / ours.peak_rss_mib:.1f}x "
                  f"({hta.peak_rss_mib / 1024:.2f} GiB vs {ours.peak_rss_mib / 1024:.2f} GiB)")


if __name__ == "__main__":
    main()
