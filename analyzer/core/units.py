"""How sizes and times read: sizes typed by people (`80GiB`, `80GB`, `80e9`, `24g`) parsed, sizes written in binary
units for people (one formatter, three unit policies), times relative to the start of the recording."""
from __future__ import annotations

import re
from typing import Literal

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


#: how a size is written: `auto` the largest binary unit it fills (tables: "512 B", "1.50 MiB", "80.00 GiB"),
#: `GiB` GiB from SMALLEST_GIB up (sentences comparing sizes: "0.50 GiB of 80.00 GiB"; "16 B", not "0.00 GiB"), `rate` MiB below a GiB and GiB above
#: (a per-step growth reads best in MiB: "+12.0 MiB per step")
ByteUnits = Literal["auto", "GiB", "rate"]
_BINARY = ("B", "KiB", "MiB", "GiB", "TiB")
#: below this a size written in GiB reads 0.00 or 0.01 GiB, which says nothing: it is written in the unit it fills
SMALLEST_GIB = 2**30 // 100


def binary_unit(n: int | float) -> tuple[int, str]:
    """(bytes in it, name) of the largest binary unit the size fills, B below 1 KiB: how `auto` writes a size
    and how a chart picks its axis unit."""
    magnitude = abs(float(n))
    return next(((1024**p, _BINARY[p]) for p in range(len(_BINARY) - 1, 0, -1) if magnitude >= 1024**p), (1, "B"))


def format_bytes(n: int | float | None, units: ByteUnits = "auto") -> str:
    """A size for people, in binary units by the `units` policy; "unknown" for None."""
    if n is None:
        return "unknown"
    if units == "GiB" and abs(n) >= SMALLEST_GIB:
        return f"{n / 2**30:.2f} GiB"
    if units == "rate":
        return f"{n / 2**20:.1f} MiB" if abs(n) < 2**30 else f"{n / 2**30:.2f} GiB"
    scale, name = binary_unit(n)
    value = float(n)
    sign = "-" if value < 0 else ""
    value = abs(value) / scale   # exact: scale is a power of two
    return f"{sign}{value:.0f} {name}" if scale == 1 else f"{sign}{value:.2f} {name}"


def human_bytes(n: int | float | None) -> str:
    """format_bytes(n): the largest unit it fills, as every report table writes sizes."""
    return format_bytes(n)


def gib(n: int | float | None) -> str:
    """format_bytes(n, "GiB"): always GiB, as the diagnosis's sentences write sizes."""
    return format_bytes(n, "GiB")


def rate_bytes(n: int | float | None) -> str:
    """format_bytes(n, "rate"): MiB below a GiB, GiB above, as per-step growth is written."""
    return format_bytes(n, "rate")


def relative_seconds(t_us: int | None, origin_us: int | None) -> str:
    """'12.345 s' after the recording's origin."""
    if t_us is None or origin_us is None:
        return "time not recorded"
    return f"{(t_us - origin_us) / 1e6:.3f} s"
