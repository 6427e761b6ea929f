"""The traced program as a stream of events, in the order they happened: what the tracer records and what the
allocator model replays. Plain data, no torch, so that traces can be built by hand in tests.

Labels are the ground truth the simulation knows and a real recording does not: which module was running,
in which phase of the training step, and what the tensor is for.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# the simulator's words are the analysis's (runner.py takes them from here: a line added there moves every
# recorded frame of the fixtures)
from analyzer.core.vocabulary import PHASES, PROFILER_STEP_PREFIX, Category, Phase, Role  # noqa: F401

#: the ground truth's categories: the analysis's, with buffers kept apart from parameters (a recording cannot
#: tell them apart, the simulator can); in this order in `.truth.json`
CATEGORIES: tuple[str, ...] = tuple(c.value for c in (Role.PARAMETER, Role.BUFFER, Role.GRADIENT, Role.OPTIMIZER_STATE,
                                                     Category.ACTIVATION, Category.TEMPORARY, Category.INPUT,
                                                     Category.OTHER))
#: the uid standing for a storage's address in the tracer's `tensor::` marks until the replay gives it one
UID_MARK = "uid:"


@dataclass
class Alloc:
    """A tensor storage was created on the (simulated) GPU."""

    uid: int
    nbytes: int
    time_us: int
    frames: list[dict[str, Any]]
    module: str
    phase: str
    step: int
    category: str = Category.OTHER.value     # settled when the trace is finished (a storage's role shows only later)
    stream: int = 0
    module_class: str = ""                   # the class of `module` ("" when unknown or none)


@dataclass
class Free:
    """The last reference to a storage went away."""

    uid: int
    time_us: int
    frames: list[dict[str, Any]] | None = None   # the stack at the free (None: the allocation's, as before)


@dataclass
class Annotation:
    """A record_function range boundary (`Optimizer.step#Adam.step`, `ProfilerStep#1`, user ranges)."""

    name: str
    stage: str                  # START | END
    time_us: int


Event = Alloc | Free | Annotation


@dataclass
class TracedRun:
    """Everything one traced run produced."""

    events: list[Event] = field(default_factory=list)
    steps: int = 0
