"""A pytest plugin that fails a test over its GPU memory budget, saying what is over and the cheapest fix.

    pytest --gpu-memory-budget 40GiB             # the budget of every test marked @pytest.mark.gpu_memory_budget
    @pytest.mark.gpu_memory_budget("8GiB")       # a test's own budget

A marked test runs recorded: on a CUDA device by `analyzer.capture` (memory history, the snapshot at its end or
at an OOM), else under the simulator's device (analyzer.simulate: the test's tensors are traced on the CPU as
the CUDA caching allocator would see them), which the test's report says. The recording is analysed with the
budget as the device's memory and checked as `analyze check RUN --budget SIZE` checks it (analyzer.gate); a
test over it fails with the check's own words, and its recording is kept for `analyze`.

Registered as a pytest11 entry point, so it loads wherever the package is installed: it is inert unless a test
is marked, and imports nothing beyond pytest until one is.
"""
from __future__ import annotations

import re
import tempfile
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest

MARKER = "gpu_memory_budget"
OPTION = "--gpu-memory-budget"
SIMULATED = ("no CUDA device: recorded under analyzer's simulated device (the test's tensors traced on the CPU as "
             "the CUDA caching allocator would see them; kernels' own workspaces are not seen)")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.getgroup("gpu memory").addoption(
        OPTION, metavar="SIZE", help=f"the GPU memory budget of tests marked {MARKER}, e.g. 40GiB: a test that "
                                     "needs more fails, saying what is over and the cheapest fix")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"{MARKER}(size=None): record the test's GPU memory and fail it over the "
                                       f"budget (its own size, else {OPTION})")


def pytest_report_header(config: pytest.Config) -> str | None:
    budget = config.getoption(OPTION)
    return None if budget is None else f"gpu memory budget: {budget} for tests marked {MARKER}"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, Any, Any]:
    marker = item.get_closest_marker(MARKER)
    if marker is None:
        return (yield)
    budget = _budget(item, marker)
    folder = _folder(item)
    recorder = _CudaRecorder(folder) if _cuda() else _SimulatedRecorder(folder)
    with recorder:
        result = yield
    from analyzer.errors import AnalyzerError
    from analyzer.gate.compare import check_budget
    from analyzer.gate.inputs import NoGpuMemory, read_run
    from analyzer.gate.render import render_text

    device = "" if recorder.on_gpu else f"\n{SIMULATED}"
    recording = recorder.recording()
    if recording is None:
        pytest.fail(f"the test's GPU memory was not recorded: {recorder.missing()}", pytrace=False)
    try:
        check = check_budget(read_run(recording, budget), budget)
    except NoGpuMemory:
        item.add_report_section("call", "gpu memory", f"the test allocated no GPU memory: it holds any budget{device}")
        return result
    except AnalyzerError as error:
        pytest.fail(f"the test's GPU memory cannot be checked: {error}{device}", pytrace=False)
    said = render_text(check) + device
    if not check.holds:
        pytest.fail(f"{said}\nthe recording is kept: analyze {recording}", pytrace=False)
    item.add_report_section("call", "gpu memory", said)
    return result


def _budget(item: pytest.Item, marker: pytest.Mark) -> int:
    from analyzer.core.units import parse_bytes

    text = marker.args[0] if marker.args else marker.kwargs.get("size") or item.config.getoption(OPTION)
    if text is None:
        raise pytest.UsageError(f"{item.nodeid} is marked {MARKER} without a size, and {OPTION} is not given")
    try:
        return parse_bytes(str(text))
    except ValueError:
        raise pytest.UsageError(f"{item.nodeid}: {MARKER} {text!r} is not a size (use e.g. 40GiB)") from None


def _folder(item: pytest.Item) -> Path:
    """Where the test's recording goes: pytest's cache (kept for analyze), else a temporary folder."""
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", item.nodeid)[-120:]
    cache = getattr(item.config, "cache", None)
    base = cache.mkdir("analyzer-gpu-memory") if cache is not None else Path(tempfile.mkdtemp(prefix="gpu-memory-"))
    folder = base / name
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        pytest.fail("recording a test's GPU memory needs torch, which is not installed", pytrace=False)
    return bool(torch.cuda.is_available())


class _CudaRecorder:
    """analyzer.capture around the test: its snapshot at the end, or at the OOM."""

    on_gpu = True

    def __init__(self, folder: Path) -> None:
        from analyzer.recording import Capture

        self._capture = Capture(folder, dump_at_steps=())

    def __enter__(self) -> None:
        self._capture.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self._capture.__exit__(*exc)

    def recording(self) -> Path | None:
        return self._capture.files[-1] if self._capture.files else None

    def missing(self) -> str:
        """Why nothing was dumped: what this torch cannot record, as the capture says it."""
        return "; ".join(self._capture.unavailable) or "another capture was already recording this process"


class _SimulatedRecorder:
    """The simulator's tracer around the test, then its allocations replayed on the allocator model."""

    on_gpu = False

    def __init__(self, folder: Path) -> None:
        from analyzer.simulate.tracer import Tracer

        self._tracer = Tracer()
        self._out = folder / "simulated.pickle"

    def __enter__(self) -> None:
        self._tracer.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self._tracer.__exit__(*exc)

    def missing(self) -> str:
        return ""

    def recording(self) -> Path | None:
        from analyzer.simulate.simulation import simulate
        from analyzer.simulate.snapshot_writer import write_snapshot

        write_snapshot(simulate(self._tracer.run, None).snapshot(), self._out)
        return self._out
