"""Run commands as child processes and measure each one's wall time and peak RSS (os.wait4 gives the
child's own rusage, so runs never contaminate each other's numbers)."""
from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass
from statistics import median


@dataclass
class Run:
    seconds: float
    peak_rss_mib: float
    cpu_seconds: float = 0.0      # user + system: what other work on a shared machine inflates least


def measure(command: list[str]) -> Run:
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(process.pid, 0)
    seconds = time.perf_counter() - start
    error = process.stderr.read().decode(errors="replace") if process.stderr else ""
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{command} failed: {error[-500:]}")
    return Run(seconds, usage.ru_maxrss / 1024, usage.ru_utime + usage.ru_stime)


def compare(commands: dict[str, list[str]], repeats: int) -> dict[str, Run]:
    """Median wall time, peak RSS and CPU time of each command, runs interleaved so load changes hit all alike."""
    runs: dict[str, list[Run]] = {name: [] for name in commands}
    for _ in range(repeats):
        for name, command in commands.items():
            runs[name].append(measure(command))
    return {name: Run(median(r.seconds for r in rs), median(r.peak_rss_mib for r in rs),
                      median(r.cpu_seconds for r in rs)) for name, rs in runs.items()}


def print_table(results: dict[str, Run], baseline: str) -> None:
    base = results[baseline]
    print(f"{'tool':<34} {'wall s':>8} {'cpu s':>7} {'peak RSS MiB':>13} {'time ratio':>11} {'cpu ratio':>10} "
          f"{'RSS ratio':>10}")
    for name, r in results.items():
        print(f"{name:<34} {r.seconds:>8.2f} {r.cpu_seconds:>7.2f} {r.peak_rss_mib:>13.0f} "
              f"{r.seconds / base.seconds:>10.2f}x {r.cpu_seconds / base.cpu_seconds:>9.2f}x "
              f"{r.peak_rss_mib / base.peak_rss_mib:>9.2f}x")
