"""Record one run well by default: CUDA memory history on, Python stacks, dumps at chosen steps, at exit and on OOM.

Most out-of-memory reports arrive with a recording that cannot explain them: history never enabled, history
switched off (and so cleared) before the dump, C++ stacks that take minutes to symbolise, no phase marks, or an
OOM caught by some framework before anything was written. `Capture` makes the good recording the default:

    cap = analyzer.capture("run_dir")               # also: @analyzer.capture("run_dir") on the training function
    analyzer.tag_modules(model)
    with cap:
        for batch in loader:
            with analyzer.phase("forward"):
                loss = model(batch)
            with analyzer.phase("backward"):
                loss.backward()
            with analyzer.phase("optimizer"):
                opt.step(); opt.zero_grad()
            cap.step()                              # once per iteration: dumps at the chosen steps

Files written to `run_dir` (R is the global rank: RANK, else LOCAL_RANK, else 0, so torchrun ranks never
collide), all pickled with protocol 4 so PyTorch's own viewer (pytorch.org/memory_viz) opens them too:

    rank{R}_step{N}.pickle           after the N-th `cap.step()`, for N in `dump_at_steps`
    rank{R}_step{N}_exit.pickle      when the block ends without an out-of-memory error (N steps done)
    rank{R}_step{N}_oom{K}.pickle    the K-th out-of-memory error (at most MAX_OOM_DUMPS per capture)
    rank{R}_trace.json.gz            without CUDA: a profiler trace of host memory (see `Capture`)

Nothing here imports torch until it is used, so analysing a file never imports torch.
"""
from __future__ import annotations

import contextlib
import gzip
import inspect
import json
import os
import pickle
import re
import sys
import threading
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Literal

from analyzer.recording.oom import attach_oom_observer, find_oom

PICKLE_PROTOCOL = 4                 # what PyTorch's web viewer and every supported Python read
DEFAULT_MAX_ENTRIES = 100_000       # alloc/free events kept: a few steps of a large model, a few KB each
MAX_OOM_DUMPS = 3                   # cuDNN and friends may OOM, retry smaller and succeed, many times a step


class CaptureWarning(UserWarning):
    """Something this machine or torch version cannot record; the message says exactly what is missing."""


def rank_from_env() -> int:
    """The global rank torchrun (or any launcher) set, so that every rank writes its own files."""
    for variable in ("RANK", "LOCAL_RANK"):
        value = os.environ.get(variable, "")
        if value.isdigit():
            return int(value)
    return 0


_ACTIVE: Capture | None = None      # the capture recording in this process (the OOM observer dumps through it)


def _on_allocator_oom(device: int, allocated: int, device_total: int, device_free: int) -> None:
    """The allocator's OOM observer: dump through the active capture while its history is still on."""
    active = _ACTIVE
    if active is None:
        return
    try:
        active.dump_oom()
    except Exception as error:  # never turn an OOM into a crash inside the allocator
        warnings.warn(f"could not dump the snapshot at an out-of-memory error: {error}", CaptureWarning, stacklevel=2)


def _history_options(record: Callable[..., Any], context: str, stacks: str, max_entries: int,
                     notes: list[str]) -> dict[str, Any] | None:
    """Keyword arguments for `_record_memory_history` that this torch accepts; None before torch 2.1."""
    parameters = inspect.signature(record).parameters
    if "max_entries" not in parameters:
        notes.append("this torch is older than 2.1: CUDA memory history is not recorded")
        return None
    options: dict[str, Any] = {"enabled": "all", "context": context, "stacks": stacks, "max_entries": max_entries}
    if "global_record_annotations" in parameters:
        options["global_record_annotations"] = True
    else:
        notes.append("this torch cannot record annotations from every thread (no global_record_annotations): "
                     "module::backward ranges, which run on autograd's thread, may be missing from snapshots")
    return options


class Capture(contextlib.ContextDecorator):
    """Record one run: CUDA memory history with snapshots at chosen steps, at exit and on OOM.

    - `run_dir`: where files go (created). `dump_at_steps`: after which `step()` calls to dump.
    - `max_entries`, `stacks`, `context`: passed to `_record_memory_history`. Python stacks by default: C++
      frames make dumps take minutes. Annotations are recorded from all threads where torch can.
    - `count_optimizer_steps`: count a step at every `optimizer.step()` (for scripts that never call `step()`;
      `analyze run` uses it).

    On OOM the snapshot is dumped by the allocator's observer, or else when a torch.OutOfMemoryError (even
    wrapped) leaves the block, always before history is switched off; the error is re-raised.

    Without CUDA, host memory is recorded instead by torch.profiler (profile_memory, record_shapes,
    with_stack) into `rank{R}_trace.json.gz`, written when the last step of `dump_at_steps` completes or at
    exit; it has no allocator segments and nothing is dumped on OOM. A `CaptureWarning` says so, as it does
    for every other feature this torch lacks.

    A capture started while another is recording in the process (for instance under `analyze run`) joins
    it: its `step()` counts steps of the running one, which keeps its own directory and options.
    """

    def __init__(self, run_dir: str | Path = "memory_capture", *, dump_at_steps: Iterable[int] = (1, 3),
                 max_entries: int = DEFAULT_MAX_ENTRIES, stacks: str = "python", context: str = "all",
                 count_optimizer_steps: bool = False) -> None:
        self.run_dir = Path(run_dir)
        self.dump_at_steps = frozenset(dump_at_steps)
        self.max_entries, self.stacks, self.context = max_entries, stacks, context
        self.count_optimizer_steps = count_optimizer_steps
        self.rank = rank_from_env()
        self.steps = 0
        self.files: list[Path] = []
        self.unavailable: list[str] = []
        self._mode: str | None = None            # "cuda", "cpu", or None when not recording
        self._joined: Capture | None = None
        self._profiler: Any = None
        self._optimizer_hook: Any = None
        self._oom_dumps = 0
        self._oom_seen_this_step = False
        self._lock = threading.Lock()

    def __enter__(self) -> Capture:
        self.start()
        return self

    def __exit__(self, _type: Any, error: BaseException | None, _traceback: Any) -> Literal[False]:
        self.stop(error)
        return False

    # -- lifecycle --
    def start(self) -> None:
        global _ACTIVE
        if _ACTIVE is self:
            raise RuntimeError("this capture is already recording (a decorated function called itself?)")
        if _ACTIVE is not None:
            self._joined = _ACTIVE
            _ACTIVE.stop_counting_optimizer_steps()  # steps now come from our step()
            return
        import torch
        from torch.optim.optimizer import register_optimizer_step_post_hook

        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.steps, self._oom_dumps, self.unavailable = 0, 0, []
        if self.count_optimizer_steps:
            self._optimizer_hook = register_optimizer_step_post_hook(self._count_optimizer_step)
        if torch.cuda.is_available():
            self._start_cuda()
        else:
            self._start_profiler()
        _ACTIVE = self
        for note in self.unavailable:
            warnings.warn(note, CaptureWarning, stacklevel=3)

    def stop(self, error: BaseException | None = None) -> None:
        """End the recording: the exit (or OOM) dump, then history off; the profiler trace without CUDA."""
        global _ACTIVE
        if self._joined is not None:
            self._joined.dump_if_oom(error)
            self._joined = None
            return
        try:
            if self._mode == "cuda":
                self._stop_cuda(error)
            elif self._mode == "cpu":
                self._finish_profiler()
        finally:
            self.stop_counting_optimizer_steps()
            self._mode = None
            if _ACTIVE is self:
                _ACTIVE = None

    def step(self) -> Path | None:
        """Call once per training iteration; returns the file written at this step, if any."""
        if self._joined is not None:
            return self._joined.step()
        self.steps += 1
        self._oom_seen_this_step = False
        if self._mode == "cuda" and self.steps in self.dump_at_steps:
            return self._dump(f"step{self.steps}")
        if self._profiler is not None:
            self._profiler.step()
            if self.steps >= max(self.dump_at_steps, default=sys.maxsize):
                return self._finish_profiler()
        return None

    def _count_optimizer_step(self, *_: Any) -> None:
        """The optimizer step post-hook of `count_optimizer_steps`: each step() of an optimizer is a step."""
        self.step()

    def stop_counting_optimizer_steps(self) -> None:
        if self._optimizer_hook is not None:
            self._optimizer_hook.remove()
            self._optimizer_hook = None

    # -- CUDA --
    def _start_cuda(self) -> None:
        import torch

        memory = torch.cuda.memory
        options = _history_options(memory._record_memory_history, self.context, self.stacks, self.max_entries,
                                   self.unavailable)
        if options is None:
            return
        attach_oom_observer(_on_allocator_oom, self.unavailable)
        memory._record_memory_history(**options)
        self._mode = "cuda"

    def _stop_cuda(self, error: BaseException | None) -> None:
        import torch

        try:
            if not self.dump_if_oom(error):
                self._dump(f"step{self.steps}_exit")
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)  # only now: switching off loses the history

    def dump_if_oom(self, error: BaseException | None) -> bool:
        """Dump for an out-of-memory error in `error`'s chain unless the allocator's observer already did in
        this step; True when `error` is one (its dump stands for the exit dump)."""
        if self._mode != "cuda" or find_oom(error) is None:
            return False
        if not self._oom_seen_this_step:
            self.dump_oom()
        return True

    def dump_oom(self) -> Path | None:
        """Dump for an out-of-memory error now (at most MAX_OOM_DUMPS per capture)."""
        with self._lock:
            self._oom_seen_this_step = True
            if self._oom_dumps >= MAX_OOM_DUMPS:
                return None
            self._oom_dumps += 1
            number = self._oom_dumps
        path = self._dump(f"step{self.steps}_oom{number}")
        print(f"analyzer.capture: out of memory; snapshot written to {path} (analyze {path})", file=sys.stderr)
        return path

    def _dump(self, name: str) -> Path:
        """Write the snapshot whole or not at all (a crash mid-write leaves no truncated file)."""
        import torch

        snapshot = torch.cuda.memory._snapshot()
        path = self.run_dir / f"rank{self.rank}_{name}.pickle"
        partial = path.with_name(path.name + ".partial")
        with self._lock:
            with open(partial, "wb") as stream:
                pickle.dump(snapshot, stream, protocol=PICKLE_PROTOCOL)
            os.replace(partial, path)
            self.files.append(path)
        return path

    # -- without CUDA --
    def _start_profiler(self) -> None:
        from torch.profiler import ProfilerAction, ProfilerActivity, profile

        self.unavailable.append(f"CUDA is not available: recording host (CPU) memory with the PyTorch profiler into "
                                f"{self._trace_path()} instead of a CUDA memory snapshot (no allocator segments, "
                                f"no snapshot on out-of-memory)")
        # a schedule that always records: only with a schedule does profiler.step() mark ProfilerStep#N ranges
        self._profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                                 with_stack=True, schedule=lambda _step: ProfilerAction.RECORD)
        self._profiler.start()
        self._mode = "cpu"

    def _finish_profiler(self) -> Path | None:
        profiler, self._profiler = self._profiler, None
        if profiler is None:
            return None
        profiler.stop()
        path = self._trace_path()
        plain = path.with_name(path.name[:-len(".gz")] + ".partial")
        profiler.export_chrome_trace(str(plain))
        with open(plain, encoding="utf-8", errors="surrogateescape") as src, \
                gzip.open(path, "wt", encoding="utf-8", errors="surrogateescape") as out:
            out.writelines(map(_json_line, src))
        plain.unlink()
        self.files.append(path)
        return path

    def _trace_path(self) -> Path:
        return self.run_dir / f"rank{self.rank}_trace.json.gz"


_NAME_LINE = re.compile(r'^(\s*"name": ")(.*)("(?:,)?\s*)$')


def _json_line(line: str) -> str:
    """A line of torch's pretty-printed Chrome trace with the quotes inside an event's name escaped: torch 2.13
    writes some names unescaped (a docstring's three quotes after `torch/profiler/_cupti_monitor.py(0):`), which
    no JSON reader takes."""
    m = _NAME_LINE.match(line)
    if m is None or '"' not in m.group(2):   # no quote inside the name: nothing can be bare
        return line
    try:
        json.loads("{" + line.strip().rstrip(",") + "}")
        return line
    except ValueError:
        return m.group(1) + re.sub(r'(?<!\\)"', r'\\"', m.group(2)) + m.group(3)
