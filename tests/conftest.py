"""Shared fixtures: where the real recordings live, and a skip (with its reason) only when they are absent."""
from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
REAL = ROOT.parent / "shared" / "real"
FIXTURES = ROOT / "fixtures" / "traces"


@pytest.fixture(scope="session")
def real_dir() -> Path:
    if not REAL.is_dir():
        pytest.skip(f"real recordings not found at {REAL} (they live in ../shared/real beside the checkout)")
    return REAL


def real_snapshots() -> list[Path]:
    """Every snapshot pickle under ../shared/real (empty when the folder is absent)."""
    if not REAL.is_dir():
        return []
    return sorted(p for p in REAL.rglob("*") if p.suffix in (".pickle", ".pkl"))
