"""Record every tensor storage a PyTorch program creates and frees, as the CUDA caching allocator would see them.

The program runs on the CPU (real small tensors, or FakeTensorMode for sizes no CPU could hold); a
TorchDispatchMode sees every operator's outputs, and a storage not seen before is an allocation of its
`nbytes()`; a weakref finalizer on the storage reports its free. A storage counts as GPU memory when the
operator that made it read a GPU storage, or read no tensor at all (a factory such as `randn` or `empty`): on a
GPU run those would be on the device, while tensors built from Python values (`torch.tensor(...)`, Adam's step
counters) stay on the host.

Labels recorded with each allocation: the Python stack (innermost first, frames as torch writes them;
empty in the backward pass, where a real GPU run allocates from autograd's C++ thread), the innermost module
running (ModTracker's forward and backward hooks), the phase set by the runner, the step, and the category,
settled at the end from what each storage turned out to be.

Not seen: memory a kernel allocates internally (cuBLAS/cuDNN workspaces, temporaries inside one aten kernel),
and anything a CUDA-only code path would do differently from the CPU one.
"""
from __future__ import annotations

import contextlib
import sys
import weakref
from collections.abc import Iterable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import torch
from torch.distributed._tools.mod_tracker import ModTracker
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from analyzer.core.vocabulary import Category, Phase, Role, module_label, phase_label, tensor_mark
from analyzer.simulate.events import PHASES, UID_MARK, Alloc, Annotation, Free, TracedRun

#: what `stacks=` records: Python frames only, or the native (C++ and CPython) frames interleaved with them
STACKS = ("python", "all")

_ENTER = torch.ops.profiler._record_function_enter_new.default
_EXIT = torch.ops.profiler._record_function_exit._RecordFunction
# the tracer itself and the wrappers torch puts around a dispatch mode: not frames a GPU run would record
_TORCH_DIR = Path(torch.__file__).parent
_HIDDEN_FILES = (str(Path(__file__)), str(_TORCH_DIR / "utils" / "_python_dispatch.py"),
                 str(_TORCH_DIR / "_dynamo" / "eval_frame.py"), str(_TORCH_DIR / "_compile.py"),
                 weakref.__file__)   # the finalizer that reports a free runs where the last reference went away
_ENGINE_FILE = str(_TORCH_DIR / "autograd" / "graph.py")
_BASE_TIME_US = 1_760_000_000_000_000   # a plausible epoch time, so traces read like real ones
_TICK_US = 10                            # the virtual clock advances this much per event: reproducible files


class _Stacks:
    """Interned frame dicts and frame lists: torch shares them between entries, which keeps pickles small."""

    def __init__(self) -> None:
        self._frames: dict[tuple, dict[str, Any]] = {}
        self._lists: dict[tuple, list[dict[str, Any]]] = {}

    def capture(self, outermost: Any, in_backward: bool = False) -> list[dict[str, Any]]:
        """The Python frames a GPU run records here, innermost first. In the backward pass that is only what runs
        inside autograd's engine (a custom Function's backward, a saved-tensor hook recomputing a checkpointed
        forward): a GPU run executes it on the engine's device thread, which has no other Python frames."""
        return self.frames_of(python_frames(sys._getframe(3), outermost, in_backward))

    def frames_of(self, shown: list[FrameType]) -> list[dict[str, Any]]:
        keys = tuple((f.f_code.co_filename, f.f_lineno, f.f_code.co_name) for f in shown)
        frames = self._lists.get(keys)
        if frames is None:
            frames = [self.frame(k) for k in keys]
            self._lists[keys] = frames
        return frames

    def frame(self, key: tuple) -> dict[str, Any]:
        return self._frames.setdefault(key, {"filename": key[0], "line": key[1], "name": key[2]})

    def intern(self, key: tuple, build: Any) -> list[dict[str, Any]]:
        frames = self._lists.get(key)
        if frames is None:
            frames = self._lists[key] = [f if isinstance(f, dict) else self.frame(f) for f in build()]
        return frames


def python_frames(start: FrameType | None, outermost: Any, in_backward: bool) -> list[FrameType]:
    """The frames from `start` out to `outermost` that a recording would show (not the tracer's own); in the
    backward pass only those inside autograd's engine (None of them when the engine runs C++ nodes only)."""
    shown: list[FrameType] = []
    frame = start
    while frame is not None:
        code = frame.f_code
        if in_backward and code.co_name == "_engine_run_backward" and code.co_filename == _ENGINE_FILE:
            return shown
        if code.co_filename not in _HIDDEN_FILES:
            shown.append(frame)
        if frame is outermost:
            break
        frame = frame.f_back
    return [] if in_backward else shown


TENSOR_MARK_ROLES = tuple(r.value for r in Role)


def native_stack(stacks: _Stacks, start: FrameType, outermost: Any, func: Any, in_backward: bool
                 ) -> list[dict[str, Any]]:
    from analyzer.simulate.native_frames import allocation_stack

    return allocation_stack(stacks, python_frames(start, outermost, in_backward), func, in_backward)


def free_stack(stacks: _Stacks, start: FrameType, outermost: Any, in_backward: bool) -> list[dict[str, Any]]:
    from analyzer.simulate.native_frames import free_stack as build

    return build(stacks, python_frames(start, outermost, in_backward), in_backward)


class Tracer(TorchDispatchMode):
    """Use as a context manager around the program; the runner sets `phase` and `step` and marks roles."""

    def __init__(self, fake: bool = False, stacks: str = "python") -> None:
        super().__init__()
        if stacks not in STACKS:
            raise ValueError(f"stacks must be one of {STACKS}, not {stacks!r}")
        self.fake = fake
        self.stacks = stacks
        self.run = TracedRun()
        self.phase = Phase.OTHER.value
        self.step = 0
        self._clock = _BASE_TIME_US
        self._stacks = _Stacks()
        self._outermost: Any = None
        self._gpu: dict[int, tuple[int, int]] = {}     # storage key -> (uid, nbytes) of live GPU storages
        self._allocs: dict[int, Alloc] = {}
        self._freed_at: dict[int, int] = {}
        self._roles: dict[int, tuple[str, str | None]] = {}   # uid -> (category, module or None to keep)
        self._forward_ends: dict[int, int] = {}
        self._window = -1                               # the forward computation running (a forward pass or the
        self._window_of: dict[int, int] = {}            # recomputation of a checkpointed one), its allocations
        self._window_end: dict[int, int] = {}           # and when it ended
        self._class: dict[str, str] = {}                # module FQN -> class name
        self._param_owner: dict[int, str] = {}          # id of a parameter -> the first module holding it
        self._compiled = False                          # the model runs under torch.compile
        self._finalizers: list[weakref.finalize] = []
        self._open_ranges: list[str] = []              # record_function ranges nest per thread
        self._fqn: dict[int, str] = {}
        self._owner: dict[int, str] = {}               # storage key of a parameter/buffer -> owning module
        self._forward_modules: list[str] = []
        self._backward_modules: list[str] = []
        self._made_in_forward: dict[int, torch.nn.Module] = {}   # kept alive until their backward has run
        self._mod_tracker = ModTracker()
        self._mod_tracker.register_user_hooks(self._pre_fw, self._post_fw, self._pre_bw, self._post_bw)
        self._exit = contextlib.ExitStack()

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """Off while torch.compile traces and compiles, on while the compiled code runs: without it Dynamo
        skips every frame while a dispatch mode is active and the "compiled" model runs eagerly."""
        return True

    # ---- entering and leaving ----------------------------------------------------------------------
    def __enter__(self) -> Tracer:
        self._outermost = sys._getframe(1)
        if self.fake:
            from torch._subclasses.fake_tensor import FakeTensorMode

            self._exit.enter_context(FakeTensorMode())
        self._exit.enter_context(self._mod_tracker)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self._exit.close()
        for finalizer in self._finalizers:
            finalizer.detach()
        self._settle_categories()

    # ---- what the runner tells us ------------------------------------------------------------------
    @contextlib.contextmanager
    def in_phase(self, phase: str) -> Iterator[None]:
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}; one of {PHASES}")
        previous, self.phase = self.phase, str(phase)
        self.annotate(phase_label(phase), "START")  # as analyzer.phase() records it
        if phase == Phase.FORWARD:
            self._window = len(self._window_end)
            self._window_end[self._window] = -1
        try:
            yield
        finally:
            if phase == Phase.BACKWARD:
                self._close_backward_modules()
            self.annotate(phase_label(phase), "END")
            if phase == Phase.FORWARD:
                self._forward_ends[self.step] = self._window_end[self._window] = self._clock
                self._window = -1
            self.phase = previous

    def watch_model(self, model: torch.nn.Module) -> None:
        """Name modules by their FQN; parameters and buffers alive now are the model's states. A model under
        torch.compile is named as the module it wraps (its parameters are that module's), and what its compiled
        forward and backward allocate belongs to it: no submodule's hook runs inside compiled code."""
        original = getattr(model, "_orig_mod", None)
        if isinstance(original, torch.nn.Module):
            model, self._compiled = original, True
        for name, module in model.named_modules():
            self._fqn[id(module)] = name
            self._class[name] = type(module).__name__
            for tensor, category in [*((p, Role.PARAMETER.value) for p in module.parameters(recurse=False)),
                                     *((b, Role.BUFFER.value) for b in module.buffers(recurse=False))]:
                key = self._key(tensor)
                if key in self._owner:          # a tied weight belongs to the first module that holds it
                    continue
                self._owner[key] = name
                if category == Role.PARAMETER:
                    self._param_owner[id(tensor)] = name
                self.mark([tensor], category, name)

    def mark(self, tensors: Iterable[Any], category: str, module: str | None = None) -> None:
        """Settle what these tensors' storages are (an input batch, a gradient, optimizer state ...). Model
        states with an owner are also marked in the recording as analyzer.tag_modules marks them
        (`tensor::<role>::<fqn>::uid:<n>`, the uid replaced by the block's address when replayed)."""
        for tensor in tensors:
            if isinstance(tensor, torch.Tensor):
                entry = self._gpu.get(self._key(tensor))
                if entry is not None:
                    self._roles[entry[0]] = (category, module)
                    if module is not None and category in TENSOR_MARK_ROLES:
                        name = tensor_mark(category, module, f"{UID_MARK}{entry[0]}")
                        self.annotate(name, "START")
                        self.annotate(name, "END")

    def owner(self, tensor: torch.Tensor) -> str | None:
        """The module that holds this parameter or buffer (a parameter's owner even after `p.data = ...`)."""
        owner = self._param_owner.get(id(tensor))
        return owner if owner is not None else self._owner.get(self._key(tensor))

    def role_of(self, tensor: torch.Tensor) -> str | None:
        """The role marked for the live storage of this tensor (None: not marked, or not on the device)."""
        entry = self._gpu.get(self._key(tensor))
        role = self._roles.get(entry[0]) if entry is not None else None
        return role[0] if role is not None else None

    def mark_parameters(self, model: torch.nn.Module) -> None:
        """What every `p in model.parameters()` holds now is a parameter of its owning module: after an
        optimizer that replaced `p.data`, the new storage (the old one was a parameter until it was freed)."""
        for param in model.parameters():
            if self.role_of(param) != Role.PARAMETER:
                owner = self.owner(param)
                self._owner[self._key(param)] = owner or ""
                self.mark([param], Role.PARAMETER.value, owner)

    def annotate(self, name: str, stage: str) -> None:
        self.run.events.append(Annotation(name, stage, self._tick()))

    # ---- the dispatch hook -------------------------------------------------------------------------
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func is _ENTER:
            self._open_ranges.append(args[0])
            self.annotate(args[0], "START")
        elif func is _EXIT:
            if self._open_ranges:
                self.annotate(self._open_ranges.pop(), "END")
        else:
            self._record_outputs(func, args, kwargs, out)
        return out

    def _record_outputs(self, func: Any, args: tuple, kwargs: dict | None, out: Any) -> None:
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        on_gpu = not inputs or any(self._key(t) in self._gpu for t in inputs)
        for tensor in tree_flatten(out)[0]:
            if not isinstance(tensor, torch.Tensor):
                continue
            storage = tensor.untyped_storage()
            key, nbytes = storage._cdata, storage.nbytes()
            known = self._gpu.get(key)
            if known is not None and known[1] == nbytes:
                continue
            if known is not None:          # resized in place (out= ops): the allocator sees a free and a new block
                self._on_free(key, known[0])
            if on_gpu and nbytes > 0:
                self._new_storage(storage, key, nbytes, func)

    def _new_storage(self, storage: Any, key: int, nbytes: int, func: Any) -> None:
        uid = len(self._allocs)
        in_backward = self._mod_tracker.is_bw
        if self.stacks == "all":
            frames = native_stack(self._stacks, sys._getframe(3), self._outermost, func, in_backward)
        else:
            frames = self._stacks.capture(self._outermost, in_backward)
        module = self._current_module(in_backward)
        running = bool(self._forward_modules or (in_backward and self._backward_modules)
                       or (self._compiled and self.phase in (Phase.FORWARD, Phase.BACKWARD)))
        alloc = Alloc(uid=uid, nbytes=nbytes, time_us=self._tick(), frames=frames, module=module,
                      phase=self.phase, step=self.step, module_class=self._class.get(module, "") if running else "")
        if self._window >= 0:
            self._window_of[uid] = self._window
        self._allocs[uid] = alloc
        self._gpu[key] = (uid, nbytes)
        self.run.events.append(alloc)
        self._finalizers.append(weakref.finalize(storage, self._on_free, key, uid))

    def _on_free(self, key: int, uid: int) -> None:
        if self._gpu.get(key, (None,))[0] != uid:
            return
        del self._gpu[key]
        time_us = self._tick()
        self._freed_at[uid] = time_us
        frames = None
        if self.stacks == "all":
            frames = free_stack(self._stacks, sys._getframe(1), self._outermost, self._mod_tracker.is_bw)
        self.run.events.append(Free(uid, time_us, frames))

    # ---- modules -----------------------------------------------------------------------------------
    # Module ranges are recorded as analyzer.tag_modules() records them: module::forward|backward::FQN.
    def _name(self, module: torch.nn.Module) -> str:
        """A module's FQN; one the model does not hold (a loss module made in forward) goes by its class name."""
        name = self._fqn.get(id(module))
        if name is None:
            name = type(module).__name__
            self._class.setdefault(name, name)
        return name

    def _pre_fw(self, module: torch.nn.Module, _inputs: Any) -> None:
        name = self._name(module)
        if id(module) not in self._fqn:
            # A loss module made inside forward would be gone before backward reaches it; kept, its backward
            # hooks name the backward work that mirrors its forward (the gradient of the logits).
            self._made_in_forward[id(module)] = module
        if not self._forward_modules and self._window < 0 and self._mod_tracker.is_bw:
            self._window = len(self._window_end)       # a checkpointed forward recomputed in backward
            self._window_end[self._window] = -1
        self._forward_modules.append(name)
        self.annotate(module_label(Phase.FORWARD, name), "START")

    def _post_fw(self, module: torch.nn.Module, _inputs: Any, _outputs: Any) -> None:
        if self._forward_modules:
            self.annotate(module_label(Phase.FORWARD, self._forward_modules.pop()), "END")
        if not self._forward_modules and self.phase != Phase.FORWARD and self._window >= 0:
            self._window_end[self._window] = self._clock
            self._window = -1

    def _pre_bw(self, module: torch.nn.Module | None, _grads: Any) -> None:
        if module is None:        # gone before backward reached it
            return
        name = self._name(module)
        self._backward_modules.append(name)
        self.annotate(module_label(Phase.BACKWARD, name), "START")

    def _post_bw(self, module: torch.nn.Module | None, _grads: Any) -> None:
        if module is None:
            return
        self._made_in_forward.pop(id(module), None)
        name = self._name(module)
        if name in self._backward_modules:
            self._backward_modules.remove(name)
            self.annotate(module_label(Phase.BACKWARD, name), "END")

    def _close_backward_modules(self) -> None:
        """A module whose backward post-hook never fired (an `nn.Identity` that returns its input: its input's
        gradient hook is never reached) is not computing once the backward pass is over: without this it would
        stay the deepest active module and claim every later step's backward work."""
        for name in reversed(self._backward_modules):
            self.annotate(module_label(Phase.BACKWARD, name), "END")
        self._backward_modules.clear()
        self._made_in_forward.clear()

    def _current_module(self, in_backward: bool) -> str:
        if not in_backward or self._forward_modules:     # forward, or a forward recomputed in backward
            return self._forward_modules[-1] if self._forward_modules else ""
        if not self._backward_modules:
            return ""
        # hooks of nested modules fire together; the deepest active module, latest first, is the one computing
        return max(reversed(self._backward_modules), key=lambda n: n.count(".") + bool(n))

    # ---- helpers -----------------------------------------------------------------------------------
    @staticmethod
    def _key(tensor: torch.Tensor) -> int:
        return tensor.untyped_storage()._cdata

    def _tick(self) -> int:
        self._clock += _TICK_US
        return self._clock

    def _settle_categories(self) -> None:
        """A storage's category from the role the runner marked, else from when it was made and how long it lived."""
        for uid, alloc in self._allocs.items():
            role = self._roles.get(uid)
            if role is not None:
                alloc.category = role[0]
                if role[1] is not None:
                    alloc.module = role[1]
                    alloc.module_class = self._class.get(role[1], "")
            elif uid in self._window_of:     # made by a forward computation: saved for backward if it outlived it
                freed = self._freed_at.get(uid)
                ended = self._window_end.get(self._window_of[uid], -1)
                outlived_forward = freed is None or ended < 0 or freed > ended
                alloc.category = (Category.ACTIVATION if outlived_forward else Category.TEMPORARY).value
            elif alloc.phase in (Phase.BACKWARD, Phase.OPTIMIZER, Phase.LOAD):
                alloc.category = Category.TEMPORARY.value
            else:
                alloc.category = Category.OTHER.value
