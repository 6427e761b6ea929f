"""How numbers read in every report: binary units, times relative to the start of the recording."""
from __future__ import annotations

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def human_bytes(n: int | float | None) -> str:
    if n is None:
        return "unknown"
    value, unit = float(n), 0
    sign = "-" if value < 0 else ""
    value = abs(value)
    while value >= 1024 and unit < len(_UNITS) - 1:
        value /= 1024
        unit += 1
    return f"{sign}{value:.0f} {_UNITS[unit]}" if unit == 0 else f"{sign}{value:.2f} {_UNITS[unit]}"


def relative_seconds(t_us: int | None, origin_us: int | None) -> str:
    if t_us is None or origin_us is None:
        return "time not recorded"
    return f"{(t_us - origin_us) / 1e6:.3f} s"
