"""Modules on the real snapshots that have Python frames (issue 16): the share of the peak's bytes whose module
is unattributed, per file and as the median over those files, and the form of the labels.

Measured (benchmarks/attribution_accuracy.py prints the table): the median went from 78% to 66% (20 files).
The issue's bar, 20%, is out of reach without guessing: in 13 of the 20 files most of the peak was allocated
before the recording began (blocks with no frames), by code that runs no module (a notebook cell, a script's
top level, FlexGen's hand-written layers, obfuscated frames), or is model state whose parameters have no
frames to name their module. Where the peak was made inside modules' code, the share is at or below 22%.
"""
from __future__ import annotations

import statistics
from functools import cache
from pathlib import Path

import pytest

import analyzer
from analyzer.attribute import attribute
from analyzer.core.vocabulary import MODULE_PATH_SEPARATOR, UNATTRIBUTED
from analyzer.evaluate.module_classes import has_python_frames, unattributed_module_share
from support.paths import REAL, real_snapshots

MEDIAN_REACHED = 0.67      # 0.661 today (0.781 before call paths); the bar is 0.20: see the docstring
# files whose peak was made inside modules' code: the bound each reaches (today's share in the comment)
WITHIN_MODULES = {
    "constructor-sun-code_location/memory_snapshot.pickle": 0.03,       # 2.3%
    "magma27-cs336-a2/memory_snapshot.pickle": 0.15,                    # 14.6%
    "mercuryb1-sqattn/cuda_memory_snapshot.pickle": 0.16,               # 15.7%
    "shreyansh26-mlsys-experiments/profile_grad.pkl": 0.10,             # 9.0%  (100% before: torch's Linear)
    "wedsonlin-cs336-a2/medium_1024_training_memory_snapshot.pickle": 0.22,   # 21.5% (27.1% before: backward)
    "hugepanda-octree-nca/inference2_peso_oct.pickle": 0.61,            # 60.2% (100% before: torch's Conv2d)
    "jaspersolt-eor_nn/snapshot.pickle": 0.53,                          # 52.3% (74.1% before)
}

pytestmark = pytest.mark.skipif(not REAL.is_dir(), reason="../shared/real is absent")


@cache
def shares() -> dict[str, float]:
    out = {}
    for path in real_snapshots():
        trace = analyzer.load(path)
        if not isinstance(trace, analyzer.MemoryTrace) or not has_python_frames(trace):
            continue
        share = unattributed_module_share(attribute(trace))
        if share is not None:
            out[str(path.relative_to(REAL))] = share
    return out


def test_median_unattributed_module_share():
    got = shares()
    assert len(got) >= 15, got
    assert statistics.median(got.values()) <= MEDIAN_REACHED, got


@pytest.mark.parametrize("name", sorted(WITHIN_MODULES))
def test_files_made_inside_modules(name):
    assert shares()[name] <= WITHIN_MODULES[name]


def test_labels_are_call_paths_of_classes_or_frames():
    """No `Class.forward` labels any more; every level of a call path is a class (numbered where it repeats) or a
    frame's `file:line forward|__init__` text."""
    import re

    level = re.compile(r"^([A-Za-z_]\w*|.+\.py:\d+ (forward|__init__))(\[\d+\])?$|^[\w\-]+(\.[\w\-]+)*$|^\(root module\)$")
    for path in real_snapshots():
        trace = analyzer.load(path)
        if not isinstance(trace, analyzer.MemoryTrace):
            continue
        for label in attribute(trace).allocations["module"].astype(str).unique():
            if label == UNATTRIBUTED:
                continue
            assert not label.endswith(".forward"), (path, label)
            for part in label.split(MODULE_PATH_SEPARATOR):
                assert level.match(part), (Path(path).name, label)
