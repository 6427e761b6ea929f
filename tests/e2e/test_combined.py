"""`analyze snapshot.pickle run.sqlite`: the memory outside PyTorch, measured against a planted value."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from support.paths import FIXTURES

NSYS = FIXTURES / "nsys"
PLANTED_OUTSIDE = 1536 * 2**20   # the NCCL buffer scripts/make_nsys_fixtures.py cudaMallocs outside PyTorch


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "analyzer", *args], capture_output=True, text=True, timeout=120)


def test_snapshot_with_its_nsys_export_finds_the_planted_outside_memory(tmp_path: Path) -> None:
    for pair in ((NSYS / "oom_with_nccl.pickle", NSYS / "oom_with_nccl.sqlite"),
                 (NSYS / "oom_with_nccl.sqlite", NSYS / "oom_with_nccl.pickle")):  # either order
        run = _run(str(pair[0]), str(pair[1]), "--format", "json", "-q")
        assert run.returncode == 0, run.stderr
        device = json.loads(run.stdout)["devices"][0]
        outside = next(f for f in device["findings"] if f["kind"] == "outside_pytorch")
        assert outside["bytes"] == PLANTED_OUTSIDE
        assert device["capacity_bytes"] == 80 * 2**30  # from the export's TARGET_INFO_GPU
        assert device["oom"] is not None


def test_two_snapshots_are_refused_with_one_line() -> None:
    run = _run(str(FIXTURES / "sim" / "leak.pickle"), str(FIXTURES / "sim" / "healthy.pickle"))
    assert run.returncode == 2 and len(run.stderr.strip().splitlines()) == 1
    assert "Nsight export" in run.stderr
