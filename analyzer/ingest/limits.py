"""How many devices one input may name, checked by the readers before any per-device work.

Every device costs a pass of reading, attribution, timeline and diagnosis (tens of milliseconds), so an input
naming thousands of devices in a few kilobytes would keep the analyzer busy for minutes. No process drives
more than a few dozen GPUs; set ANALYZER_MAX_DEVICES to allow more.
"""
from __future__ import annotations

import os
from collections.abc import Collection

from analyzer.errors import ResourceLimit

DEFAULT_MAX_DEVICES = 64


def max_devices() -> int:
    return int(os.environ.get("ANALYZER_MAX_DEVICES", DEFAULT_MAX_DEVICES))


def check_devices(devices: Collection, path: str) -> None:
    """Raise ResourceLimit when `devices` (distinct device ids) are more than the limit."""
    limit = max_devices()
    if len(devices) > limit:
        raise ResourceLimit(path, f"the input names {len(devices)} devices, more than the {limit} one process can have",
                            "Raise ANALYZER_MAX_DEVICES if the recording really covers that many.")
