"""Hostile-input tests that feed the readers thousands of inputs (every cut of a file, fuzzed variants) read them
in this process: what they test is each reader's handling of the bytes, and a forked, limited child per input
would only multiply the time by the fork (the limits themselves are tested in test_round2.py)."""
from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import analyzer.ingest


def _unconfined(read: Callable[[], Any], path: Path) -> Any:
    return read()


@pytest.fixture(scope="module")
def in_process() -> Iterator[None]:
    """`analyzer.ingest.load` runs its reader here, without the child process and its limits (module-wide, so
    that hypothesis tests may use it too)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(analyzer.ingest, "confined", _unconfined)
        yield
