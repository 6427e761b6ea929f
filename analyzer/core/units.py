"""Sizes typed by people: `80GiB`, `80GB`, `80e9`, `24g`."""
from __future__ import annotations

import re

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_bytes(text: str) -> int:
    """Bytes from a size with an optional unit (decimal kB/MB/GB/TB, binary KiB/MiB/GiB/TiB)."""
    m = _SIZE.match(text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (use e.g. 80GiB, 80GB or 80e9)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def parse_count(text: str) -> float:
    """Counts such as `7e9`, `7B`, `70b`, `350M`."""
    m = re.match(r"^\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmbt]?)\s*$", text, re.IGNORECASE)
    if not m:
        raise ValueError(f"not a count: {text!r} (use e.g. 7e9 or 7B)")
    return float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}[m.group(2).lower()]
