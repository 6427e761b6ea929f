"""Named ranges every memory tool shows, and `phase()`, which marks the parts of a training step with them.

A range is a `torch.profiler.record_function` (snapshots: `external_annotations` with START/END stages;
profiler traces: `user_annotation` spans) plus an NVTX range (the `nvtx` package, shown by Nsight Systems).
`phase(name)` is the range `phase::<name>` (analyzer.core.vocabulary.phase_label; the attribution parses it with
parse_phase_label).
"""
from __future__ import annotations

import contextlib
import functools
import threading
import types
import warnings
from collections.abc import Iterator

from analyzer.core.vocabulary import phase_label
from analyzer.recording.session import CaptureWarning


@functools.cache
def _nvtx() -> types.ModuleType | None:
    """The `nvtx` package, or None (with a warning, once) where it is not installed."""
    try:
        import nvtx
    except ImportError:
        warnings.warn("the nvtx package is not installed: phases and modules are not shown in Nsight Systems "
                      "(pip install nvtx); profiler traces and snapshots still get them", CaptureWarning, stacklevel=2)
        return None
    return nvtx


class Range:
    """One open range, opened on creation and ended by `close()`.

    NVTX start/end ranges are used rather than push/pop because module backward ranges do not nest strictly
    and the last one may be closed by autograd's end-of-backward callback."""

    __slots__ = ("label", "thread", "_record", "_nvtx_id")

    def __init__(self, label: str) -> None:
        from torch.profiler import record_function

        self.label = label
        self.thread = threading.get_ident()
        self._record = record_function(label)
        self._record.__enter__()
        nvtx = _nvtx()
        self._nvtx_id = nvtx.start_range(message=label) if nvtx else None

    def close(self) -> None:
        self._record.__exit__(None, None, None)
        if self._nvtx_id is not None:
            nvtx = _nvtx()
            assert nvtx is not None, "the range was started with nvtx, and _nvtx() is cached"
            nvtx.end_range(self._nvtx_id)


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Mark a phase of the step (`forward`, `backward`, `optimizer`, `checkpoint`, ...) as `phase::<name>`.

    Usable as `with analyzer.phase("forward"):` or as a decorator."""
    opened = Range(phase_label(name))
    try:
        yield
    finally:
        opened.close()
