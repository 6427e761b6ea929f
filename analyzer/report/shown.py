"""The one boundary where strings of the input enter the reports: every string of the report view is made
visible (controls, separators and bidi overrides escaped) and shortened past MAX_SHOWN characters, and the view
says how many were shortened. HTML, Markdown, PDF and the terminal all render this view."""
from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

from analyzer.core.printable import MAX_SHOWN, visible

T = TypeVar("T")


def shown(view: T) -> T:
    """`view` (a ReportView) with every string in its dataclasses and lists passed through `visible`; a warning
    is added when any string was shortened."""
    shortened = [0]
    result = _walk(view, shortened)
    if shortened[0] and hasattr(result, "warnings"):
        result.warnings.append(f"{shortened[0]} string(s) from the input longer than {MAX_SHOWN} characters are "
                               "shown shortened (their start and end); the JSON report keeps what the reader kept")
    return result


def _walk(value: Any, shortened: list[int]) -> Any:
    if isinstance(value, str):
        if len(value) > MAX_SHOWN:
            shortened[0] += 1
        return visible(value)
    if isinstance(value, list):
        return [_walk(v, shortened) for v in value]
    if isinstance(value, tuple):
        return tuple(_walk(v, shortened) for v in value)
    if isinstance(value, dict):
        return {k: _walk(v, shortened) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(value, **{f.name: _walk(getattr(value, f.name), shortened)
                                             for f in dataclasses.fields(value) if f.init})
    return value
