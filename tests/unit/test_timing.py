"""The phase of allocations without Python frames (analyzer.attribute.timing), on each side of each rule."""
from __future__ import annotations

import pandas as pd

from analyzer.attribute import attribute
from analyzer.attribute.timing import MAX_FORWARD_RUN
from support.snapshots import MiB, Recording

MODEL = "/src/model.py:14"
ENGINE = ("torch::autograd::Engine::evaluate_function(...)", "torch::autograd::Engine::thread_main(...)")
KERNEL = ("at::native::empty_cuda(...)", "dequantize_4bit(...)")


def phases_of_frameless(run: int, native: tuple[str, ...] = (), after_forward: bool = True) -> list[str]:
    """A forward pass with `run` frameless allocations in the middle of it (or at its end)."""
    rec = Recording()
    rec.alloc(1 * MiB, MODEL, name="forward")
    frameless = [rec.alloc(1 * MiB, with_frames=False, native=native) for _ in range(run)]
    if after_forward:
        rec.alloc(1 * MiB, MODEL, name="forward")
    a = attribute(rec.trace()).allocations
    rows = a["addr"].isin(frameless)
    return [str(p) for p in a.loc[rows, "phase"]]


def test_a_short_frameless_run_inside_the_forward_is_forward() -> None:
    assert set(phases_of_frameless(MAX_FORWARD_RUN)) == {"forward"}


def test_a_longer_frameless_run_is_the_backward() -> None:
    assert set(phases_of_frameless(MAX_FORWARD_RUN + 1)) == {"backward"}


def test_a_frameless_run_after_the_last_forward_allocation_is_the_backward() -> None:
    assert set(phases_of_frameless(1, after_forward=False)) == {"backward"}


def test_with_cpp_frames_only_autograds_engine_makes_it_backward() -> None:
    assert set(phases_of_frameless(MAX_FORWARD_RUN + 3, native=ENGINE)) == {"backward"}
    assert set(phases_of_frameless(MAX_FORWARD_RUN + 3, native=KERNEL)) == {"forward"}  # the neighbours decide


def test_the_signal_is_named() -> None:
    rec = Recording()
    rec.alloc(1 * MiB, MODEL, name="forward")
    rec.alloc(1 * MiB, with_frames=False)
    rec.alloc(1 * MiB, MODEL, name="forward")
    a = attribute(rec.trace()).allocations
    assert pd.Series(a["label_source"].astype(str)).str.contains("phase=timing:inside-forward").sum() == 1
