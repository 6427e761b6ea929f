"""Seeing an out-of-memory error wherever it ends up: inside a wrapped error, or caught before the block sees it."""
from __future__ import annotations

from collections.abc import Callable

_OBSERVER_ATTACHED = False          # the allocator keeps observers forever: attach one per process


def find_oom(error: BaseException | None) -> BaseException | None:
    """The torch.OutOfMemoryError in `error` or anywhere in its __cause__/__context__ chain.

    Frameworks wrap OOMs (a RuntimeError raised `from` it, or raised while handling it), and the wrapper is
    what reaches the `with` block."""
    if error is None:
        return None
    import torch

    pending, seen = [error], set()
    while pending:
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, torch.cuda.OutOfMemoryError):
            return current
        pending.extend(e for e in (current.__cause__, current.__context__) if e is not None)
    return None


def attach_oom_observer(observer: Callable[[int, int, int, int], None], notes: list[str]) -> None:
    """Have the caching allocator call `observer(device, allocated, device_total, device_free)` just before it
    raises OutOfMemoryError, the one moment that sees an OOM a framework catches afterwards.

    Only the first observer is attached (observers cannot be removed), so it must find its capture itself;
    `notes` gets a line where this torch has no observer hook."""
    global _OBSERVER_ATTACHED
    import torch

    attach = getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)
    if attach is None:
        notes.append("this torch has no allocator OOM observer: an out-of-memory error is dumped only if it "
                     "reaches the capture block")
    elif not _OBSERVER_ATTACHED:
        attach(observer)
        _OBSERVER_ATTACHED = True
