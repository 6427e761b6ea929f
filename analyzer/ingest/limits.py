"""How many devices one input may name, checked by the readers before any per-device work; and how many of the
files of a set (a folder or archive of ranks) skipped are named one by one.

Every device costs a pass of reading, attribution, timeline and diagnosis (tens of milliseconds), so an input
naming thousands of devices in a few kilobytes would keep the analyzer busy for minutes. No process drives
more than a few dozen GPUs; set ANALYZER_MAX_DEVICES to allow more. A folder of 100,000 empty files, or an
archive of 20,000 junk members, named each skipped file in the report's warnings (6 MB reports; 75 s for a PDF).
"""
from __future__ import annotations

import os
from collections.abc import Collection

from analyzer.errors import ResourceLimit

DEFAULT_MAX_DEVICES = 64
#: skipped files of a set named in the warnings; the others are counted in one line
SKIPPED_NAMED = 20


def max_devices() -> int:
    return int(os.environ.get("ANALYZER_MAX_DEVICES", DEFAULT_MAX_DEVICES))


def check_devices(devices: Collection, path: str) -> None:
    """Raise ResourceLimit when `devices` (distinct device ids) are more than the limit."""
    limit = max_devices()
    if len(devices) > limit:
        raise ResourceLimit(path, f"the input names {len(devices)} devices, more than the {limit} one process can have",
                            "Raise ANALYZER_MAX_DEVICES if the recording really covers that many.")


def named_skips(warnings: list[str]) -> list[str]:
    """`warnings` with only the first SKIPPED_NAMED 'skipped ...' lines kept, the others counted in one line."""
    kept, seen = [], 0
    for warning in warnings:
        seen += warning.startswith("skipped ")
        if seen <= SKIPPED_NAMED or not warning.startswith("skipped "):
            kept.append(warning)
    more = seen - SKIPPED_NAMED
    return kept + [f"skipped {more} more files (not recordings of one rank, empty, or unreadable)"] if more > 0 \
        else kept
