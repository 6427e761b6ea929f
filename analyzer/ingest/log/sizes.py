"""Sizes as logs print them, to bytes.

Every writer we read prints binary multiples, whatever it calls them: the caching allocator's `format_size`
(c10/cuda/CUDACachingAllocator.cpp) writes `bytes`, `KiB`, `MiB`, `GiB` with two decimals; the MPS allocator
and `memory_summary()` before torch 1.8 write `KB`/`MB`/`GB` for the same powers of 1024; DeepSpeed's
`see_memory_usage`, SGLang's `avail mem=` and Megatron's `memory (MB)` divide by 1024**3 and 1024**2 and print
`GB`/`MB`. So `GB` here is 2**30, never 10**9 (nvidia-smi's `MiB` is 2**20 as it says).
"""
from __future__ import annotations

import re

_SCALE = {"b": 1, "byte": 1, "bytes": 1, "kb": 2**10, "kib": 2**10, "k": 2**10, "mb": 2**20, "mib": 2**20,
          "m": 2**20, "gb": 2**30, "gib": 2**30, "g": 2**30, "tb": 2**40, "tib": 2**40, "pb": 2**50, "pib": 2**50}

#: a number and its unit as the writers above print them ("20.00 MiB", "0 bytes", "1.2GiB", "10240MiB")
SIZE = r"(\d+(?:\.\d+)?)\s*(bytes|byte|[KMGTP]i?B|B)"
_SIZE_RE = re.compile(SIZE, re.IGNORECASE)


def to_bytes(number: str, unit: str) -> int:
    """Bytes of a printed number and unit (binary multiples, see the module docstring)."""
    return round(float(number) * _SCALE[unit.lower()])


def size_bytes(text: str) -> int | None:
    """Bytes of the first size in `text`, None if it holds none."""
    m = _SIZE_RE.search(text)
    return to_bytes(m.group(1), m.group(2)) if m else None


def rounding(number: str, unit: str) -> int:
    """Half a unit of the last printed digit, in bytes: how far the printed size can be from the true one."""
    decimals = len(number.partition(".")[2])
    return round(_SCALE[unit.lower()] * 0.5 * 10 ** -decimals)
