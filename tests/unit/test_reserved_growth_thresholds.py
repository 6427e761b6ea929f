"""The reserved-growth finding at its boundary, on a hand-made ratchet (stated here as the spec): the reserve
grows each measured step while what is kept does not, by at least MIN_SHARE_OF_RESERVED = 0.5% of the reserved
peak; less is noise.

Each step makes a 64 MiB activation in a new segment and frees it, the segment kept cached: the reserve grows
64 MiB a step. Weights of W bytes stay alive, so the reserved peak is W + 6 × 64 MiB and the boundary is at
64 MiB = 0.5% × (W + 384 MiB), W = 12416 MiB; the weights sit one allocator block (512 bytes) either side.
"""
from __future__ import annotations

import analyzer
from analyzer.result import ReservedGrowthFinding
from support.snapshots import BLOCK, MiB, Recording

MIN_SHARE_OF_RESERVED = 0.005
GROWTH = 64 * MiB
STEPS = 6
AT = int(GROWTH / MIN_SHARE_OF_RESERVED) - STEPS * GROWTH   # weights that put the growth at the boundary


def _findings(weights: int, **options) -> list[ReservedGrowthFinding]:
    rec = Recording()
    with rec.step(0), rec.phase("load"):
        rec.alloc(weights, where="model.py:10")
    for step in range(1, STEPS + 1):
        with rec.step(step), rec.phase("forward"):
            rec.free(rec.alloc(GROWTH, where="model.py:40"))
    d = analyzer.analyze(rec.trace(), **options).devices[0]
    assert d.reserved_peak_bytes == weights + STEPS * GROWTH
    return [f for f in d.diagnosis.findings if f.kind == "reserved_growth"]


def test_growth_at_the_share_of_the_reserved_peak_is_a_finding():
    (finding,) = _findings(AT - BLOCK)
    assert finding.bytes_per_step == GROWTH


def test_growth_under_the_share_is_noise():
    assert not _findings(AT + BLOCK)


def test_the_share_is_a_threshold_of_the_python_api():
    assert analyzer.Thresholds().reserved_growth_min_share == MIN_SHARE_OF_RESERVED
    assert _findings(AT + BLOCK, thresholds=analyzer.Thresholds(reserved_growth_min_share=0.004))
