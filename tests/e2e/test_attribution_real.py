"""Attribution on every real snapshot: of the peak bytes that carry Python frames, the share labelled with a
phase and a category. (Bytes without frames, allocated before the recording or with C++-only stacks, can
only be unattributed.)"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import analyzer
from support.paths import REAL, real_snapshots

TARGET = 0.95


def _labelled_share(path: Path) -> tuple[int, int]:
    """(peak bytes with Python frames, of which labelled) over the devices of one snapshot."""
    result = analyzer.analyze(path)
    has_python = np.asarray([any(f[0].endswith(".py") for f in frames) for frames in result.trace.stacks["frames"]]
                            + [False])
    with_frames = labelled = 0
    for d in result.devices:
        live = d.peak.live
        framed = has_python[live["stack_id"].to_numpy(dtype=np.int64, na_value=-1)]
        known = (live["phase"] != "unattributed").to_numpy() & (live["category"] != "unattributed").to_numpy()
        weights = live["allocated_bytes"].to_numpy()
        with_frames += int(weights[framed].sum())
        labelled += int(weights[framed & known].sum())
    return with_frames, labelled


def test_peak_bytes_with_frames_are_labelled_on_real_snapshots() -> None:
    snapshots = real_snapshots()
    if not snapshots:
        pytest.skip(f"no real snapshots at {REAL}")
    totals = np.zeros(2, dtype=np.int64)
    for path in snapshots:
        if "mosaic" in path.parts:  # Mosaic's test fixture: random frames and sizes, not a recording
            continue
        with_frames, labelled = _labelled_share(path)
        totals += (with_frames, labelled)
        print(f"{path.relative_to(REAL)}: {labelled / with_frames:.1%} of {with_frames} framed peak bytes"
              if with_frames else f"{path.relative_to(REAL)}: no framed peak bytes")
    share = totals[1] / totals[0]
    print(f"all real snapshots: {share:.2%} of the peak bytes that carry Python frames are labelled")
    assert share >= TARGET
