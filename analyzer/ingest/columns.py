"""Compact columns for readers: int64 arrays (`array('q')`) with a sentinel for "missing", turned into numpy
and pandas nullable columns. A Python list of a million ints costs ~36 MB; an array costs 8 MB, and
appending to it is as fast, so large inputs stay within a small multiple of their own size in memory."""
from __future__ import annotations

from array import array

import numpy as np
import pandas as pd

from analyzer.core.trace import MISSING  # never a real size, address, time or index

__all__ = ["MAX_TOTAL_BYTES", "MISSING", "to_int64", "to_nullable"]

#: the most bytes a reader accepts in any sum of sizes (1 EiB, beyond any device): totals and timelines are
#: int64, and a hostile input's sizes must not wrap them around into negative or tiny numbers
MAX_TOTAL_BYTES = 2**60


def to_int64(column: array) -> np.ndarray:
    return np.frombuffer(column, dtype=np.int64) if len(column) else np.zeros(0, dtype=np.int64)


def to_nullable(column: array | np.ndarray) -> pd.arrays.IntegerArray:
    """Int64 with NA wherever the reader stored MISSING."""
    values = to_int64(column) if isinstance(column, array) else column
    return pd.arrays.IntegerArray(values.copy(), values == MISSING)
