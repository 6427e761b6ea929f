"""Simulate a training run's GPU memory on the CPU: trace every tensor allocation of a real training step, replay
the requests through a model of PyTorch's CUDA caching allocator, and write the snapshot torch would have
written (`torch.cuda.memory._dump_snapshot`), with a ground-truth sidecar of what each allocation was.

Modules, one job each: `tracer` (torch dispatch mode + module/phase tracking), `allocator` (the caching
allocator's rules, over `blocks`, `device`, `expandable`), `snapshot_writer` (torch's dict layout), `truth`
(the sidecar), `replay` (recorded requests through the model), `scenarios` (built-in workloads), `zoo`
(transformers/PEFT/custom-optimizer/compile/autocast cases), `native_frames` (the C++ and CPython frames of
`stacks="all"`), `runner`
(`run()`); the command is `analyzer.commands.simulate`. Only `tracer`, `scenarios` and `runner` import torch, and only
when used: importing this package, or the allocator model, does not.
"""
from __future__ import annotations

from typing import Any


def run(*args: Any, **kwargs: Any):
    """Trace a user's training steps and write the simulated snapshot; see `analyzer.simulate.runner.run`."""
    from analyzer.simulate.runner import run as _run

    return _run(*args, **kwargs)


__all__ = ["run"]
