"""Attribution of a CPU-profiled training run against torch's own memory profiler categories (the
export_memory_timeline of the same run, recorded by scripts/record_kineto_fixtures.py)."""
from __future__ import annotations

from analyzer.evaluate.accuracy import profiler_agreement
from support.paths import FIXTURES

KINETO = FIXTURES / "kineto"


def test_categories_agree_with_torch_memory_profiler_at_the_peak() -> None:
    scores = profiler_agreement(KINETO / "train.pt.trace.json.gz", KINETO / "train.memory_timeline.raw.json.gz")
    print(f"bytes-weighted agreement: peak {scores['peak']:.3f} over {scores['peak_scored_bytes']} bytes, "
          f"whole recording {scores['overall']:.3f} over {scores['overall_scored_bytes']} bytes")
    assert scores["peak_scored_bytes"] > 0
    assert scores["peak"] >= 0.90
    # over the whole recording the definitions part: torch calls every forward intermediate an activation,
    # we call one freed before backward begins a temporary (it costs nothing at the peak); measured 0.83
    assert scores["overall"] >= 0.80
