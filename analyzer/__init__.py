"""analyzer: why did my GPU run out of memory, and what should I change first?

Public API:
- `load(path)` -> MemoryTrace: the input as pandas tables (allocations, segments, blocks, events, stacks,
  annotations, ooms, timeline); a MultiRankTrace (one MemoryTrace per rank) for a directory or .tar.gz of ranks.
- `analyze(path_or_trace)` -> Analysis: peaks, OOMs, findings and remedies, `Analysis.to_json()`; a
  RankSetAnalysis (one Analysis per rank) for a set of ranks; `analyze(path, thresholds=Thresholds(...))` tunes
  what the detectors call a finding.
- `capture(run_dir)`, `phase(name)`, `tag_modules(model)`: record a run well (analyzer.recording; imports torch
  only when used).

Every name is imported on first use (PEP 562): `import analyzer` alone imports nothing else, so `analyze
train.log` never pays for pandas and numpy, which only a recording's tables need.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from analyzer.core.trace import MemoryTrace, MultiRankTrace
    from analyzer.diagnose.thresholds import Thresholds
    from analyzer.ingest import load
    from analyzer.pipeline import analyze
    from analyzer.recording import capture, phase, tag_modules
    from analyzer.result import Analysis, RankSetAnalysis

__all__ = ["load", "analyze", "Thresholds", "MemoryTrace", "MultiRankTrace", "Analysis", "RankSetAnalysis", "capture",
           "phase", "tag_modules"]
__version__ = "0.1.0"

#: public name -> the module that defines it
_HOMES = {"load": "analyzer.ingest", "analyze": "analyzer.pipeline", "Thresholds": "analyzer.diagnose.thresholds",
          "MemoryTrace": "analyzer.core.trace", "MultiRankTrace": "analyzer.core.trace",
          "Analysis": "analyzer.result", "RankSetAnalysis": "analyzer.result",
          "capture": "analyzer.recording", "phase": "analyzer.recording", "tag_modules": "analyzer.recording"}


def __getattr__(name: str) -> object:
    """A public name, imported from its module on first use and kept here after."""
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'analyzer' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
