"""Issue 22 benchmark: a job of N ranks (copies of a simulated snapshot, as torchtitan names them), analysed
one rank after another in one process (`analyzer.analyze(dir)`, the Python API, then the same job report) and
on the local Dask cluster (`analyze DIR --workers W`), side by side: wall time and the driver's peak RSS. Only summaries travel back from
the workers, so the driver's memory should stay flat as N grows while the in-process run holds every Analysis.

    python benchmarks/bench_ranks.py [--ranks 16] [--workers 2] [--repeats 3]
"""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure import compare  # noqa: E402

SNAPSHOT = Path(__file__).resolve().parents[1] / "fixtures" / "traces" / "sim" / "activation_cache.pickle"


# the same work as the command (analyse every rank, build the job's report, write its JSON), in one process
IN_PROCESS = ("import analyzer; from pathlib import Path; from analyzer.job import job_of; "
              "from analyzer.commands.job_view import job_report, rank_shown; "
              "Path({out!r}).write_text(job_report(job_of(analyzer.analyze({job!r}), rank_shown)).to_json_text())")


def make_job(root: Path, ranks: int) -> Path:
    folder = root / "memory_snapshot" / "iteration_10"
    folder.mkdir(parents=True)
    for rank in range(ranks):
        shutil.copyfile(SNAPSHOT, folder / f"rank{rank}_memory_snapshot.pickle")
    return root / "memory_snapshot"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=16)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        job = make_job(Path(tmp), args.ranks)
        out = Path(tmp) / "out.json"
        runs = compare({
            "in-process, one rank after another": [sys.executable, "-c", IN_PROCESS.format(job=str(job), out=str(out))],
            f"Dask, {args.workers} workers": [sys.executable, "-m", "analyzer", str(job), "--workers",
                                              str(args.workers), "-q", "-o", str(out)],
        }, args.repeats)
    print(f"{args.ranks} ranks of {SNAPSHOT.name} ({SNAPSHOT.stat().st_size / 1e6:.2f} MB each)")
    print("| run | wall s | driver peak RSS MiB |\n| --- | ---: | ---: |")
    for name, run in runs.items():
        print(f"| {name} | {run.seconds:.1f} | {run.peak_rss_mib:.0f} |")


if __name__ == "__main__":
    main()
