"""analyzer: why did my GPU run out of memory, and what should I change first?

Public API:
- `load(path)` -> MemoryTrace: the input as pandas tables (allocations, segments, blocks, events, stacks,
  annotations, ooms, timeline); a MultiRankTrace (one MemoryTrace per rank) for a directory or .tar.gz of ranks.
- `analyze(path_or_trace)` -> Analysis: peaks, OOMs, findings and remedies, `Analysis.to_json()`; a
  RankSetAnalysis (one Analysis per rank) for a set of ranks; `analyze(path, thresholds=Thresholds(...))` tunes
  what the detectors call a finding.
- `capture(run_dir)`, `phase(name)`, `tag_modules(model)`: record a run well (analyzer.recording; imports torch
  only when used).
"""
from analyzer.core.trace import MemoryTrace, MultiRankTrace
from analyzer.diagnose.thresholds import Thresholds
from analyzer.ingest import load
from analyzer.pipeline import analyze
from analyzer.result import Analysis, RankSetAnalysis

__all__ = ["load", "analyze", "Thresholds", "MemoryTrace", "MultiRankTrace", "Analysis", "RankSetAnalysis", "capture",
           "phase", "tag_modules"]
__version__ = "0.1.0"

_CAPTURE_NAMES = frozenset({"capture", "phase", "tag_modules"})


def __getattr__(name: str) -> object:
    """The recording helpers, imported on first use so that `import analyzer` never imports torch."""
    if name in _CAPTURE_NAMES:
        import importlib

        return getattr(importlib.import_module("analyzer.recording"), name)
    raise AttributeError(f"module 'analyzer' has no attribute {name!r}")
