"""analyzer: why did my GPU run out of memory, and what should I change first?

Public API:
- `load(path)` -> MemoryTrace: the input as pandas tables (allocations, segments, blocks, events, stacks,
  annotations, ooms, timeline).
- `analyze(path_or_trace)` -> Analysis: peaks, OOMs, findings and remedies; `Analysis.to_json()`.
"""
from analyzer.analysis import Analysis, analyze
from analyzer.ingest import load
from analyzer.trace import MemoryTrace

__all__ = ["load", "analyze", "MemoryTrace", "Analysis"]
__version__ = "0.1.0"
