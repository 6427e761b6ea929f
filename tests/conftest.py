"""Shared fixtures: the real recordings, with a skip (and its reason) only when they are absent.

Tests are laid out by kind: unit/ (one module's logic on small inputs), e2e/ (the pipeline and the command line
on fixtures and real recordings), hostile/ (inputs made to break us); helpers live in the support package.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from support.paths import REAL


@pytest.fixture(scope="session")
def real_dir() -> Path:
    if not REAL.is_dir():
        pytest.skip(f"real recordings not found at {REAL} (they live in ../shared/real beside the checkout)")
    return REAL
