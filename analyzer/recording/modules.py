"""Labels naming the module behind every allocation: module ranges, the allocator's user_metadata, tensor marks.

Names written (analyzer.core.vocabulary's module_label and tensor_mark; the attribution parses them with its
parse_module_label and parse_tensor_mark):

    module::forward::<fqn>           the forward of the module called <fqn> in `model.named_modules()`; the root
                                     module's fqn is "" (`module::forward::`)
    module::backward::<fqn>          its backward, on autograd's thread; it opens when the first gradient reaches
                                     one of the call's outputs and closes when the gradients of all its inputs
                                     exist (or when the backward pass ends), so backward ranges may overlap their
                                     neighbours instead of nesting strictly (a block's range can open just after
                                     its last child's): where module ranges overlap, the innermost is the one
                                     with the deepest fqn
    tensor::<role>::<fqn>::<0xaddr>  the storage at that address is a <role> (parameter, buffer, gradient,
                                     optimizer_state) of the module <fqn>; an instant range, written when the
                                     model is tagged, at the first forward after the model moved, after each
                                     gradient accumulation and when an optimizer makes new state

Module ranges are `phases.Range`s, recorded from all threads where `_record_memory_history` has
`global_record_annotations`. On torch >= 2.10 with CUDA the allocator's `user_metadata` (thread-local in the
allocator) is also set, on the thread that runs each range, to the label of the innermost module range open on
that thread, and to "" outside any module, so every trace entry names its module even when annotations fell
out of the ring buffer.
"""
from __future__ import annotations

import inspect
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from analyzer.core.vocabulary import Phase, Role, module_label, parse_module_label, tensor_mark
from analyzer.recording.phases import Range

if TYPE_CHECKING:
    import torch


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
    _, fqn = parse_module_label(label) or ("", "")
    return fqn.count(".") + 1 if fqn else 0


class _ModuleRanges:
    """Open module ranges per thread, with the innermost one mirrored into the allocator's user_metadata.

    The allocator's metadata is per thread and backward hooks run on autograd's thread, so each thread keeps
    its own list. Backward ranges do not open in nesting order (the gradient of a block's output reaches its
    last child's hook before the block's own), so the innermost open range is the deepest module, the newest
    of equally deep ones."""

    def __init__(self, set_metadata: Callable[[str], None] | None) -> None:
        self._set_metadata = set_metadata
        self._open: dict[int, list[Range]] = {}
        self._lock = threading.Lock()

    def open(self, label: str) -> Range:
        opened = Range(label)
        with self._lock:
            self._open.setdefault(opened.thread, []).append(opened)
        self._publish(opened.thread)
        return opened

    def close(self, opened: Range) -> None:
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
        self._opened: Range | None = None
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
        calls: list[Range] = []
        handles.append(module.register_forward_pre_hook(_before_forward(ranges, fqn, calls)))
        handles.append(module.register_forward_hook(_after_forward(ranges, fqn, calls), **forward_hook_options))
    handles += _TensorMarks(model).install(model)
    return ModuleTags(handles)


class _TensorMarks:
    """Writes `tensor::<role>::<fqn>::<address>` marks, each address once: the attribution then knows which
    module owns a parameter, its gradient and its optimizer state, which no stack can tell."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._owners = {id(t): (role, fqn) for fqn, module in model.named_modules()
                        for role, tensors in ((Role.PARAMETER, module.parameters(recurse=False)),
                                              (Role.BUFFER, module.buffers(recurse=False))) for t in tensors}
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
            Range(tensor_mark(role, fqn, address)).close()

    def mark_model(self) -> None:
        for fqn, module in self._model.named_modules():
            for tensor in module.parameters(recurse=False):
                self.mark(Role.PARAMETER, fqn, tensor)
            for tensor in module.buffers(recurse=False):
                self.mark(Role.BUFFER, fqn, tensor)

    def _mark_gradient(self, parameter: torch.Tensor) -> None:
        owner = self._owners.get(id(parameter))
        if owner is not None:
            self.mark(Role.GRADIENT, owner[1], parameter.grad, once=False)

    def _mark_optimizer(self, optimizer: Any, _args: Any, _kwargs: Any) -> None:
        for parameter, state in optimizer.state.items():
            owner = self._owners.get(id(parameter))
            if owner is not None:
                for value in state.values():
                    if getattr(value, "dim", lambda: 0)() > 0:  # not the scalar step counter
                        self.mark(Role.OPTIMIZER_STATE, owner[1], value)


def _before_forward(ranges: _ModuleRanges, fqn: str, calls: list[Range]) -> Callable[..., None]:
    def hook(_module: Any, _args: Any) -> None:
        calls.append(ranges.open(module_label(Phase.FORWARD, fqn)))
    return hook


def _after_forward(ranges: _ModuleRanges, fqn: str, calls: list[Range]) -> Callable[..., None]:
    def hook(_module: Any, args: Any, output: Any) -> None:
        if calls:  # empty when the model was tagged in the middle of its own forward
            ranges.close(calls.pop())
        _BackwardCall(ranges, module_label(Phase.BACKWARD, fqn)).watch(args, output)
    return hook
