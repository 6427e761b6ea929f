"""The pytest plugin (analyzer.pytest_plugin), run by pytest in a child process on a small test file.

A marked test holds when the memory it needed is at most its budget (the marker's size, else
--gpu-memory-budget): four 4 MiB tensors alive together need exactly 16 MiB, so 16MiB holds and 16777215 bytes
fail; a test that allocates no GPU memory holds any budget. Without CUDA (this machine) the plugin records under the simulator's device and says so. Unmarked tests are
not recorded, and a run with nothing marked imports neither torch nor the gate.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from support.paths import ROOT

TESTS = '''
import pytest
import torch


def four_tensors():
    return [torch.zeros(1024, 1024) for _ in range(4)]   # 4 x 4 MiB alive together


@pytest.mark.gpu_memory_budget("16MiB")
def test_at_its_budget():
    assert len(four_tensors()) == 4


@pytest.mark.gpu_memory_budget(size="16777215")
def test_a_byte_under():
    assert len(four_tensors()) == 4


@pytest.mark.gpu_memory_budget
def test_the_option_budget():
    assert len(four_tensors()) == 4


def test_unmarked():
    assert len(four_tensors()) == 4


@pytest.mark.gpu_memory_budget("1MiB")
def test_nothing_allocated():
    assert torch.tensor([1.0]).item() == 1.0   # made from a Python value: host memory
'''

INERT = '''
import sys


def test_nothing_is_imported():
    assert "torch" not in sys.modules and "analyzer.gate" not in sys.modules
'''


def pytest_run(folder: Path, *args: str) -> subprocess.CompletedProcess:
    # without CI's variables: under CI=true pytest prints the short summary's messages whole, so each failure's
    # explanation would be counted twice
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "BUILD_NUMBER")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "analyzer.pytest_plugin", "-rA",
                           "-p", "no:randomly", *args], cwd=folder, capture_output=True, text=True, env=env,
                          timeout=600)


def test_marked_tests_are_checked_against_their_budget_on_the_simulated_device(tmp_path):
    pytest.importorskip("torch")
    (tmp_path / "test_budget.py").write_text(TESTS)
    done = pytest_run(tmp_path, "--gpu-memory-budget", "8MiB")
    out = done.stdout
    assert done.returncode == 1, out + done.stderr
    assert "gpu memory budget: 8MiB for tests marked gpu_memory_budget" in out
    assert "PASSED test_budget.py::test_at_its_budget" in out and "PASSED test_budget.py::test_unmarked" in out
    assert "FAILED test_budget.py::test_a_byte_under" in out and "FAILED test_budget.py::test_the_option_budget" in out
    assert "cuda:0 holds its budget: needs 16.00 MiB of 16.00 MiB" in out
    assert "cuda:0 is over its budget: needs 16.00 MiB, the budget is 16.00 MiB (1 B over)" in out
    assert "cuda:0 is over its budget: needs 16.00 MiB, the budget is 8.00 MiB (8.00 MiB over)" in out
    assert "largest allocation sites: " in out and "test_budget.py:7 <listcomp> 16.00 MiB" in out
    assert "PASSED test_budget.py::test_nothing_allocated" in out
    assert "the test allocated no GPU memory: it holds any budget" in out
    assert out.count("no CUDA device: recorded under analyzer's simulated device") == 4   # each marked test
    kept = tmp_path / ".pytest_cache" / "d" / "analyzer-gpu-memory" / "test_budget.py_test_a_byte_under"
    assert f"the recording is kept: analyze {kept / 'simulated.pickle'}" in out
    assert (kept / "simulated.pickle").is_file()


def test_the_plugin_is_inert_when_nothing_is_marked(tmp_path):
    (tmp_path / "test_inert.py").write_text(INERT)
    done = pytest_run(tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "gpu memory" not in done.stdout


def test_a_marker_without_a_size_needs_the_option(tmp_path):
    (tmp_path / "test_bare.py").write_text("import pytest\n\n\n@pytest.mark.gpu_memory_budget\ndef test_x():\n"
                                           "    pass\n")
    done = pytest_run(tmp_path)
    assert done.returncode != 0
    assert "test_bare.py::test_x is marked gpu_memory_budget without a size, and --gpu-memory-budget is not given" \
        in done.stdout + done.stderr
