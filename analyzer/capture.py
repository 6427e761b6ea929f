"""Record GPU memory well by default: history on, Python stacks, phases, module labels, a dump on OOM.

Most out-of-memory reports arrive with a recording that cannot explain them: history never enabled, history
switched off (and so cleared) before the dump, C++ stacks that take minutes to symbolise, no phase marks, or an
OOM caught by some framework before anything was written. These helpers make the good recording the default:

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

Annotation naming convention (the attribution code parses these names; split with `name.split("::", 2)`):

    phase::<name>                    `phase(name)`
    module::forward::<fqn>           `tag_modules`: the forward of the module called <fqn> in
                                     `model.named_modules()`; the root module's fqn is "" (`module::forward::`)
    module::backward::<fqn>          `tag_modules`: its backward, on autograd's thread; it opens when the first
                                     gradient reaches one of the call's outputs and closes when the gradients of
                                     all its inputs exist (or when the backward pass ends), so backward ranges
                                     may overlap their neighbours instead of nesting strictly (a block's range
                                     can open just after its last child's): where module ranges overlap, the
                                     innermost is the one with the deepest fqn

    tensor::<role>::<fqn>::<0xaddr>  `tag_modules`: the storage at that address is a <role> (parameter, buffer,
                                     gradient, optimizer_state) of the module <fqn>; an instant range, written
                                     when the model is tagged, at the first forward after the model moved,
                                     after each gradient accumulation and when an optimizer makes new state

Each range is a `torch.profiler.record_function` (snapshots: `external_annotations` with START/END stages,
recorded from all threads where `_record_memory_history` has `global_record_annotations`; profiler traces:
`user_annotation` spans) and an NVTX range (the `nvtx` package, shown by Nsight Systems). On torch >= 2.10 with
CUDA, `tag_modules` also sets the allocator's `user_metadata` (thread-local in the allocator) on the thread
that runs each range to the label of the innermost module range open on that thread (as above), and to ""
outside any module, so every trace entry names its module even when annotations fell out of the ring buffer.

Nothing here imports torch until it is used, so analysing a file never imports torch.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import os
import pickle
import sys
import threading
import types
import warnings
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

PHASE_PREFIX = "phase::"
MODULE_FORWARD_PREFIX = "module::forward::"
MODULE_BACKWARD_PREFIX = "module::backward::"
TENSOR_PREFIX = "tensor::"
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


# ---- annotated ranges ---------------------------------------------------------------------------------
@functools.cache
def _nvtx() -> types.ModuleType | None:
    """The `nvtx` package, or None (with a warning, once) where it is not installed."""
    try:
        import nvtx
    except ImportError:
        warnings.warn("the nvtx package is not installed: phases and modules are not shown in Nsight Systems "
                      "(pip install nvtx); profiler traces and snapshots still get them", CaptureWarning)
        return None
    return nvtx


class _Range:
    """One open annotation: a profiler range (snapshots and traces) plus an NVTX range (Nsight).

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
            _nvtx().end_range(self._nvtx_id)


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Mark a phase of the step (`forward`, `backward`, `optimizer`, `checkpoint`, ...) as `phase::<name>`.

    Usable as `with analyzer.phase("forward"):` or as a decorator."""
    opened = _Range(PHASE_PREFIX + name)
    try:
        yield
    finally:
        opened.close()


# ---- module labels ------------------------------------------------------------------------------------
def _metadata_setter() -> Callable[[str], None] | None:
    """`torch.cuda.memory._set_memory_metadata` where it exists (torch >= 2.10) and the allocator keeps it.

    Non-native allocator backends (cudaMallocAsync, pluggable) ignore metadata; newer torch says so through
    `_memory_metadata_supported()`."""
    import torch

    memory = torch.cuda.memory
    if not torch.cuda.is_available() or not hasattr(memory, "_set_memory_metadata"):
        return None
    supported = getattr(memory, "_memory_metadata_supported", None)
    if supported is not None and not supported():
        return None
    return memory._set_memory_metadata


def _depth(label: str) -> int:
    """How deep the labelled module sits in the model: 0 for the root, 1 for `embed`, 3 for `layers.0.mlp`."""
    fqn = label.rsplit("::", 1)[1]
    return fqn.count(".") + 1 if fqn else 0


class _ModuleRanges:
    """Open module ranges per thread, with the innermost one mirrored into the allocator's user_metadata.

    The allocator's metadata is per thread and backward hooks run on autograd's thread, so each thread keeps
    its own list. Backward ranges do not open in nesting order (the gradient of a block's output reaches its
    last child's hook before the block's own), so the innermost open range is the deepest module, the newest
    of equally deep ones."""

    def __init__(self, set_metadata: Callable[[str], None] | None) -> None:
        self._set_metadata = set_metadata
        self._open: dict[int, list[_Range]] = {}
        self._lock = threading.Lock()

    def open(self, label: str) -> _Range:
        opened = _Range(label)
        with self._lock:
            self._open.setdefault(opened.thread, []).append(opened)
        self._publish(opened.thread)
        return opened

    def close(self, opened: _Range) -> None:
        opened.close()
        with self._lock:
            ranges = self._open.get(opened.thread, [])
            if opened in ranges:
                ranges.remove(opened)
        self._publish(opened.thread)

    def _publish(self, thread: int) -> None:
        """Set the metadata of `thread`, which is only possible from that thread (it is thread-local)."""
        if self._set_metadata is None or thread != threading.get_ident():
            return
        with self._lock:
            ranges = self._open.get(thread)
            label = max(reversed(ranges), key=lambda r: _depth(r.label)).label if ranges else ""
        self._set_metadata(label)


def _tensors_needing_grad(value: Any) -> list[torch.Tensor]:
    """Tensors that require grad inside a module's inputs or outputs (tensors, lists, tuples, dicts)."""
    import torch

    if isinstance(value, torch.Tensor):
        return [value] if value.requires_grad else []
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors_needing_grad(item)]
    return []


class _BackwardCall:
    """The backward of one forward call, found through tensor hooks rather than module backward hooks.

    Full module backward hooks wrap outputs in a custom Function, which breaks in-place ops on them (the
    common `nn.ReLU(inplace=True)` after a block); plain tensor hooks change nothing in the user's graph."""

    def __init__(self, ranges: _ModuleRanges, label: str) -> None:
        self._ranges, self._label = ranges, label
        self._opened: _Range | None = None
        self._closed = False

    def watch(self, inputs: Any, outputs: Any) -> None:
        import torch

        outs = _tensors_needing_grad(outputs)
        if not outs:
            return
        for tensor in outs:
            tensor.register_hook(self._begin)
        ins = _tensors_needing_grad(inputs)
        if ins:
            torch.autograd.graph.register_multi_grad_hook(ins, self._end)

    def _begin(self, _grad: torch.Tensor) -> None:
        """First gradient at an output: open, and make sure the range ends with this backward pass at the
        latest (inputs that need no grad, such as token ids, never fire the end hook)."""
        import torch

        if self._opened is None and not self._closed:
            self._opened = self._ranges.open(self._label)
            torch.autograd.Variable._execution_engine.queue_callback(self._end)

    def _end(self, *_grads: Any) -> None:
        if self._opened is not None and not self._closed:
            self._closed = True
            self._ranges.close(self._opened)


class ModuleTags:
    """The hooks `tag_modules` installed; `remove()` takes them all out."""

    def __init__(self, handles: list[Any]) -> None:
        self._handles = handles

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def tag_modules(model: torch.nn.Module) -> ModuleTags:
    """Label what every module allocates: `module::forward::<fqn>` and `module::backward::<fqn>` ranges, the
    allocator's user_metadata where torch has it, and `tensor::` marks naming the module that owns each
    parameter, buffer, gradient and optimizer state (see the module docstring for the convention)."""
    ranges = _ModuleRanges(_metadata_setter())
    forward_hook_options = ({"always_call": True}  # close the range even when forward raises (an OOM)
                            if "always_call" in inspect.signature(model.register_forward_hook).parameters else {})
    handles = []
    for fqn, module in model.named_modules():
        calls: list[_Range] = []
        handles.append(module.register_forward_pre_hook(_before_forward(ranges, fqn, calls)))
        handles.append(module.register_forward_hook(_after_forward(ranges, fqn, calls), **forward_hook_options))
    handles += _TensorMarks(model).install(model)
    return ModuleTags(handles)


class _TensorMarks:
    """Writes `tensor::<role>::<fqn>::<address>` marks, each address once: the attribution then knows which
    module owns a parameter, its gradient and its optimizer state, which no stack can tell."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._owners = {id(t): (role, fqn) for fqn, module in model.named_modules()
                        for role, tensors in (("parameter", module.parameters(recurse=False)),
                                              ("buffer", module.buffers(recurse=False))) for t in tensors}
        self._model = model
        self._marked: set[tuple[str, int]] = set()

    def install(self, model: torch.nn.Module) -> list[Any]:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        self.mark_model()
        handles = [model.register_forward_pre_hook(lambda *_: self.mark_model()),  # the model may have moved
                   register_optimizer_step_post_hook(self._mark_optimizer)]
        for parameter in model.parameters():
            if parameter.requires_grad and hasattr(parameter, "register_post_accumulate_grad_hook"):
                handles.append(parameter.register_post_accumulate_grad_hook(self._mark_gradient))
        return handles

    def mark(self, role: str, fqn: str, tensor: Any, once: bool = True) -> None:
        """Mark the storage under `tensor`; with `once`, an address already marked for this role is skipped
        (parameters and optimizer states persist; gradients are new storage every step)."""
        import torch

        if not isinstance(tensor, torch.Tensor) or tensor.numel() == 0:
            return
        address = tensor.untyped_storage().data_ptr()
        if not once or (role, address) not in self._marked:
            self._marked.add((role, address))
            _Range(f"{TENSOR_PREFIX}{role}::{fqn}::{address:#x}").close()

    def mark_model(self) -> None:
        for fqn, module in self._model.named_modules():
            for tensor in module.parameters(recurse=False):
                self.mark("parameter", fqn, tensor)
            for tensor in module.buffers(recurse=False):
                self.mark("buffer", fqn, tensor)

    def _mark_gradient(self, parameter: torch.Tensor) -> None:
        owner = self._owners.get(id(parameter))
        if owner is not None:
            self.mark("gradient", owner[1], parameter.grad, once=False)

    def _mark_optimizer(self, optimizer: Any, _args: Any, _kwargs: Any) -> None:
        for parameter, state in optimizer.state.items():
            owner = self._owners.get(id(parameter))
            if owner is not None:
                for value in state.values():
                    if getattr(value, "dim", lambda: 0)() > 0:  # not the scalar step counter
                        self.mark("optimizer_state", owner[1], value)


def _before_forward(ranges: _ModuleRanges, fqn: str, calls: list[_Range]) -> Callable[..., None]:
    def hook(_module: Any, _args: Any) -> None:
        calls.append(ranges.open(MODULE_FORWARD_PREFIX + fqn))
    return hook


def _after_forward(ranges: _ModuleRanges, fqn: str, calls: list[_Range]) -> Callable[..., None]:
    def hook(_module: Any, args: Any, output: Any) -> None:
        if calls:  # empty when the model was tagged in the middle of its own forward
            ranges.close(calls.pop())
        _BackwardCall(ranges, MODULE_BACKWARD_PREFIX + fqn).watch(args, output)
    return hook


# ---- the capture --------------------------------------------------------------------------------------
_ACTIVE: Capture | None = None      # the capture recording in this process (the OOM observer dumps through it)
_OBSERVER_ATTACHED = False          # the allocator keeps observers forever: attach ours once per process


def _on_allocator_oom(device: int, allocated: int, device_total: int, device_free: int) -> None:
    """Called by the caching allocator just before it raises OutOfMemoryError, history still on: the one
    moment that sees the OOM even when a framework catches the error afterwards."""
    active = _ACTIVE
    if active is None:
        return
    try:
        active.dump_oom()
    except Exception as error:  # never turn an OOM into a crash inside the allocator
        warnings.warn(f"could not dump the snapshot at an out-of-memory error: {error}", CaptureWarning)


def _attach_oom_observer(notes: list[str]) -> None:
    global _OBSERVER_ATTACHED
    import torch

    attach = getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)
    if attach is None:
        notes.append("this torch has no allocator OOM observer: an out-of-memory error is dumped only if it "
                     "reaches the capture block")
    elif not _OBSERVER_ATTACHED:
        attach(_on_allocator_oom)
        _OBSERVER_ATTACHED = True


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

    def __exit__(self, _type: Any, error: BaseException | None, _traceback: Any) -> bool:
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
            self._optimizer_hook = register_optimizer_step_post_hook(lambda *_: self.step())
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
        _attach_oom_observer(self.unavailable)
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
        profiler.export_chrome_trace(str(path))
        self.files.append(path)
        return path

    def _trace_path(self) -> Path:
        return self.run_dir / f"rank{self.rank}_trace.json.gz"


capture = Capture


class _CallableModule(types.ModuleType):
    """Importing this submodule makes Python set `analyzer.capture` to the module, hiding the `capture`
    helper the package exports; calling the module therefore starts a capture, so `analyzer.capture(...)`
    works whichever of the two the name holds."""

    def __call__(self, *args: Any, **kwargs: Any) -> Capture:
        return Capture(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
