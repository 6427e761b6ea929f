"""The JSON of every fixture and real recording is what tests/golden pins (`python tests/support/golden.py
--update` rewrites it after a change of behaviour made on purpose)."""
from __future__ import annotations

import json

import pytest

from support import golden

CASES = golden.cases()


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_json_is_the_pinned_one(case: golden.Case) -> None:
    path = golden.golden_path(case)
    assert path.exists(), f"no golden file for {case.name}: run python tests/support/golden.py --update"
    expected = json.loads(path.read_text(encoding="utf-8"))
    actual = golden.pinned(case, golden.run(case))
    changed = golden.differences(expected, actual)
    assert not changed, f"{case.name}: these fields changed: {changed[:20]} (if on purpose: " \
                        "python tests/support/golden.py --update, then review the diff)"


def test_real_recordings_are_pinned_when_present() -> None:
    if not golden.REAL.is_dir():
        pytest.skip(f"real recordings not found at {golden.REAL}")
    assert sum(c.real for c in CASES) >= 40
