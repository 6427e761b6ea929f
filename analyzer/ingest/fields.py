"""Type checks for the fields of untrusted inputs, made before a value is turned into text or hashed.

`str()` walks a container, and a pickle can share one list many times over (a "billion laughs": a few hundred
bytes that print as terabytes) or nest lists thousands deep (a RecursionError); hashing a tuple walks it the
same way. So a field that should hold a string is checked by its type alone and refused otherwise, and the
allocator settings, the one free-form mapping a snapshot carries into the reports, keep only plain values.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

MAX_SETTING_ITEMS = 64  # roundup_power2_divisions has 16; a longer list or mapping is not an allocator setting


def text(value: Any, what: str) -> str:
    """`value` when it is a string; anything else is refused (a TypeError naming the field)."""
    if type(value) is not str:
        raise TypeError(f"{what} is {type(value).__name__}, not a string")
    return value


def require_strings(values: Iterable[Any], what: str) -> None:
    """Refuse a column of values unless every one is a string: one pass over the types, in C."""
    kinds = set(map(type, values))
    if not kinds <= {str}:
        wrong = sorted(k.__name__ for k in kinds - {str})
        raise TypeError(f"{what} must be strings, found {', '.join(wrong)}")


def plain_settings(settings: Any) -> tuple[dict[str, Any], list[str]]:
    """(the allocator settings with only string keys and plain values, the keys that were dropped).

    A value may also be a short list or mapping of plain values (roundup_power2_divisions); deeper or longer
    values are dropped, so the JSON and HTML reports never walk a structure the input chose."""
    if not isinstance(settings, dict):
        return {}, ["allocator_settings"]
    kept: dict[str, Any] = {}
    dropped: list[str] = []
    for key, value in settings.items():
        if type(key) is str and (_is_plain(value) or _is_flat(value)):
            kept[key] = value
        else:
            dropped.append(key if type(key) is str else f"<a {type(key).__name__} key>")
    return kept, dropped


def _is_plain(value: Any) -> bool:
    """A string, bool, None, int64 or finite float: what JSON and the reports print as written."""
    if type(value) is int:
        return -(2**63) <= value < 2**63
    if type(value) is float:
        return math.isfinite(value)
    return value is None or type(value) in (str, bool)


def _is_flat(value: Any) -> bool:
    if isinstance(value, Mapping):
        items: Iterable[Any] = [*value.keys(), *value.values()]
    elif isinstance(value, (list, tuple)):
        items = value
    else:
        return False
    return len(value) <= MAX_SETTING_ITEMS and all(map(_is_plain, items))
