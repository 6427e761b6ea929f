"""Shared fixtures: the real recordings, with a skip (and its reason) only when they are absent.

Tests are laid out by kind: unit/ (one module's logic on small inputs), e2e/ (the pipeline and the command line
on fixtures and real recordings), hostile/ (inputs made to break us); helpers live in the support package.

The modules in SLOW are marked `slow` (their tests run the CLI in subprocesses, every real recording, a browser,
or generated hostile inputs): `python -m pytest -m "not slow"` is the fast loop while editing; CI runs them all.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from support.paths import REAL

#: test modules taking the most time (pytest --durations on the whole suite), relative to tests/
SLOW = {"e2e/test_golden.py", "e2e/test_terminal_width.py", "e2e/test_doc_examples.py", "e2e/test_reports.py",
        "e2e/test_check.py", "e2e/test_remedy_replay_runs.py", "e2e/test_log_of_runs.py", "e2e/test_attribution_real.py",
        "e2e/test_profiler_ops_truth.py", "e2e/test_html_explorer.py", "e2e/test_real_truth.py",
        "e2e/test_json_terminal_agree.py", "unit/test_capture.py", "unit/test_pytest_plugin.py",
        "hostile/test_properties.py", "hostile/test_round2.py", "hostile/test_round3.py", "hostile/test_corpus.py"}
_TESTS = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.relative_to(_TESTS).as_posix() in SLOW:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def real_dir() -> Path:
    if not REAL.is_dir():
        pytest.skip(f"real recordings not found at {REAL} (they live in ../shared/real beside the checkout)")
    return REAL
