"""Where the tests' inputs live: the project's own fixtures, and the real recordings beside the checkout."""
from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
REAL = ROOT.parent / "shared" / "real"
FIXTURES = ROOT / "fixtures" / "traces"
SIM = FIXTURES / "sim"


def real_snapshots() -> list[Path]:
    """Every snapshot pickle under ../shared/real (empty when the folder is absent)."""
    if not REAL.is_dir():
        return []
    return sorted(p for p in REAL.rglob("*") if p.suffix in (".pickle", ".pkl"))
