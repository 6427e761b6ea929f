"""What a stack says about an allocation: the phase its torch frames reveal and the module whose forward
made it. Evaluated once per distinct stack, never per allocation."""
from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from analyzer.attribute.module_paths import CallPath, SourceIndex, call_path, path_label
from analyzer.core.stacks import Frame, format_frame, is_python_frame, is_user_frame
from analyzer.core.vocabulary import Phase

_T = r"(^|[\\/])torch[\\/]"  # a torch path component (Kineto's paths are relative: torch/nn/...)
_MODULE_FILE = _T + r"nn[\\/]modules[\\/]module\.py$"   # nn.Module itself: `_call_impl`, hooks, `to`, `_apply`
_BACKWARD, _FORWARD, _COMPILE = Phase.BACKWARD.value, Phase.FORWARD.value, Phase.COMPILE.value
_COMPILED_GRAPH = "frames:compiled-graph"
_COMPILED_BACKWARD = "frames:compiled-backward"
_AUTOGRAD = "frames:torch.autograd"


@dataclass(frozen=True)
class _Rule:
    """What one frame says about the phase. `file` is searched in the frame's file name and `function` in its
    function name (each anchored where it must be, and none can backtrack badly on a hostile name)."""

    phase: str
    signal: str
    file: re.Pattern[str] | None = None
    function: re.Pattern[str] | None = None
    kind: str = "strong"     # strong | weak: a forward seen from inside, which frames further out may overrule |
                             # compiled: torch.compile's output running, the frames outside it decide |
                             # apply: autograd.Function.apply, its forward when Python called it
    overrules_forward: bool = False   # further out than a weak forward, it still decides (recompute, autograd,
                                      # compile)
    in_compiled: str | None = None    # its signal outside a compiled graph's frames; None: it says nothing there
    native: bool = False              # about a C++ frame (every other rule is about Python frames)

    def matches(self, filename: str, function: str) -> bool:
        return ((self.file is None or self.file.search(filename) is not None)
                and (self.function is None or self.function.search(function) is not None))


def _rule(phase: str, signal: str, file: str | None = None, function: str | None = None, **options: Any) -> _Rule:
    return _Rule(phase, signal, re.compile(file) if file else None, re.compile(function) if function else None,
                 **options)


# Checked innermost frame first; for each frame the first rule that matches is the frame's (see _phase_of).
# torch.compile: autotuning (benchmarking candidate kernels and configs, at compile time or on a compiled graph's
# first call: triton.testing.do_bench and its 256 MiB L2-flush buffer, inductor's select_algorithm,
# autotune_process, runtime/benchmarking, CachingAutotuner.autotune_to_one_config/benchmark_all_configs/bench)
# and the compile itself (dynamo's tracing, AOTAutograd's, inductor's lowering and passes) are compile-time
# memory; the compiled graph running (the generated code in inductor's cache directory, default
# /tmp/torchinductor_USER/xx/cxxxx.py `call`, and its runtime wrappers: CompiledFxGraph.__call__, AOTAutograd's
# runtime_wrappers and CompiledFunction.forward/backward, cudagraph trees, inductor's runtime/) is forward or
# backward work, told apart by the frames outside it.
# what builds a model: constructors, and the loaders and weight initialisers named so
_CONSTRUCTION_FUNCTION = (r"^(__init__$|(?=\w+$).*?(init_weight|init_all_weights|load_model|load_weights|load_checkpoint|"
                          r"from_pretrained))")
_PHASE_RULES: list[_Rule] = [
    _rule(_COMPILE, "frames:compile-autotune",
          file=r"(^|[\\/])triton[\\/]testing\.py$|" + _T + r"_inductor[\\/](select_algorithm|autotune_process|"
               r"runtime[\\/]benchmarking)\.py$", in_compiled="frames:compile-autotune", overrules_forward=True),
    _rule(_COMPILE, "frames:compile-autotune", function=r"^get_empty_cache_for_benchmark$|"
          r"^(?=\w+$).*?(autotune|benchmark|bench|precompile)", file=r"(^|[\\/])triton[\\/]|" + _T + r"_inductor[\\/]",
          in_compiled="frames:compile-autotune", overrules_forward=True),
    _rule(_BACKWARD, _COMPILED_BACKWARD, file=_T + r"_functorch[\\/]_aot_autograd[\\/]runtime_wrappers\.py$",
          function=r"^(?=\w+$).*?backward", in_compiled=_COMPILED_BACKWARD, overrules_forward=True),
    _rule(_FORWARD, _COMPILED_GRAPH, kind="compiled",
          file=r"(^|[\\/])torchinductor_[^\\/]*[\\/]|" + _T + r"(_inductor[\\/](output_code\.py|cudagraph_trees\.py|"
               r"runtime[\\/])|_functorch[\\/]_aot_autograd[\\/]runtime_wrappers\.py$)"),
    _rule(_FORWARD, _COMPILED_GRAPH, kind="compiled", function=r"^(run|call_func_at_runtime_with_args|g|forward)$",
          file=_T + r"(_inductor[\\/](utils|compile_fx)\.py|_functorch[\\/](_aot_autograd[\\/]utils|aot_autograd)\.py|"
               r"_dynamo[\\/]backends[\\/]debugging\.py)$"),  # the last: aot_eager's graph, run as compiled
    _rule(_COMPILE, "frames:torch.compile", in_compiled="frames:torch.compile", overrules_forward=True,
          file=_T + r"(_dynamo[\\/](?!eval_frame\.py$|external_utils\.py$)|_inductor[\\/]|"
               r"_functorch[\\/](aot_autograd\.py$|_aot_autograd[\\/]|partitioners\.py$))"),
    # activation checkpointing's recomputation, in backward (reentrant: CheckpointFunction.backward; non-reentrant:
    # the saved-tensor unpack hook's recompute_fn); the checkpointed forward itself runs under `checkpoint`
    _rule(_BACKWARD, "frames:activation-checkpoint-recompute", file=_T + r"utils[\\/]checkpoint\.py$",
          function=r"^(?=\w+$).*?(recompute|unpack|backward)", in_compiled="frames:activation-checkpoint-recompute",
          overrules_forward=True),
    # autograd's entry points and engine (the engine's thread has C++ frames only when stacks="all"); a custom
    # Function's `apply` is its forward when Python called it, its backward when the engine did (BackwardCFunction)
    _rule(_BACKWARD, _AUTOGRAD, kind="apply", file=_T + r"autograd[\\/]function\.py$", function=r"^apply$"),
    _rule(_BACKWARD, _AUTOGRAD, in_compiled=_COMPILED_BACKWARD, overrules_forward=True,
          file=_T + r"(_tensor\.py$|autograd[\\/]__init__\.py$|autograd[\\/]graph\.py$)",
          function=r"^(backward|grad|_engine_run_backward|unpack\w*)$"),
    _rule(_BACKWARD, _AUTOGRAD, file=_T + r"autograd[\\/]functional\.py$", in_compiled=_COMPILED_BACKWARD,
          overrules_forward=True),
    _rule(_BACKWARD, "frames:autograd-engine", function=r"^torch::autograd::(Engine|python::PythonEngine)::",
          in_compiled=_COMPILED_BACKWARD, overrules_forward=True, native=True),
    _rule(Phase.OPTIMIZER.value, "frames:torch.optim", file=_T + r"optim[\\/]", in_compiled="frames:torch.optim"),
    _rule(Phase.CHECKPOINT_SAVE.value, "frames:torch.save", file=_T + r"serialization\.py$", function=r"^_?save"),
    _rule(Phase.CHECKPOINT_SAVE.value, "frames:torch.save", file=_T + r"distributed[\\/]checkpoint[\\/]"),
    _rule(Phase.CHECKPOINT_SAVE.value, "frames:state_dict",
          function=r"^(state_dict|_save_to_state_dict|full_state_dict|get_state_dict|consolidate_state_dict)$"),
    _rule(Phase.LOAD.value, "frames:load_state_dict", file=_T + r"serialization\.py$", function=r"^_?load"),
    _rule(Phase.LOAD.value, "frames:load_state_dict", function=r"(load_state_dict|_load_from_state_dict)$"),
    _rule(Phase.LOAD.value, "frames:module.to", file=_MODULE_FILE,
          function=r"^(_apply|to|cuda|convert)$"),
    _rule(Phase.LOAD.value, "frames:module-init", file=_T + r"nn[\\/]modules[\\/]\w+\.py$",
          function=r"^(__init__|reset_parameters)$"),
    _rule(Phase.LOAD.value, "frames:module-init", file=_T + r"nn[\\/]init\.py$", function=r"^\w+$"),
    _rule(_FORWARD, "frames:module.forward", kind="weak", file=_MODULE_FILE,
          function=r"^(_call_impl|_wrapped_call_impl)$"),
    _rule(Phase.CHECKPOINT_SAVE.value, "frames:user-function-name", kind="weak",
          function=r"(?i)^(?=\w+$).*?(save|state_dict|consolidate)"),
    _rule(Phase.LOAD.value, "frames:model-construction", kind="weak", function=_CONSTRUCTION_FUNCTION),
]
_FUNCTION_BACKWARD = _rule(_BACKWARD, _AUTOGRAD, in_compiled=_COMPILED_BACKWARD, overrules_forward=True)
_PYTHON_RULES = [r for r in _PHASE_RULES if not r.native]
_NATIVE_RULES = [r for r in _PHASE_RULES if r.native]


_CACHED_NAME = 4096   # frames with longer names (none in real stacks; a hostile file's) are not kept in the cache


def _rule_of(filename: str, function: str) -> _Rule | None:
    """The frame's rule: the first that matches (stacks share most of their frames, hence the cache)."""
    if len(filename) + len(function) <= _CACHED_NAME:
        return _cached_rule_of(filename, function)
    return _first_rule(filename, function)


def _first_rule(filename: str, function: str) -> _Rule | None:
    rules = _PYTHON_RULES if is_python_frame((filename, 0, function)) else _NATIVE_RULES
    return next((rule for rule in rules if rule.matches(filename, function)), None)


_cached_rule_of = lru_cache(maxsize=1 << 16)(_first_rule)


def _phase_of(frames: tuple[Frame, ...], memo: FrameMemo) -> tuple[str | None, str | None]:
    """(phase, signal) the frames say, innermost first. The first strong rule decides, except that a weak one
    seen before it (a module's forward, a user function's name) stands unless the strong one overrules a forward
    (checkpoint recomputation, autograd, compile); frames of a compiled graph defer to the frames outside them
    (autograd: backward; the optimizer; compile-time) and are forward where nothing there speaks."""
    weak: _Rule | None = None
    compiled = False
    for i, frame in enumerate(frames):
        rule = memo[frame][1]
        if rule is None:
            continue
        if rule.kind == "apply":
            if any(memo[f][0] & _PYTHON for f in frames[i + 1:]):
                continue                    # Function.apply called from Python: the Function's forward
            rule = _FUNCTION_BACKWARD       # called by autograd's engine: the Function's backward
        if rule.kind == "compiled":
            compiled = compiled or weak is None
            continue
        if rule.kind == "weak":
            weak = weak or (None if compiled else rule)
            continue
        if compiled:
            if rule.in_compiled is not None:
                return rule.phase, rule.in_compiled
            continue
        if weak is not None and not rule.overrules_forward:
            break
        return rule.phase, rule.signal
    if weak is not None:
        return weak.phase, weak.signal
    return (_FORWARD, _COMPILED_GRAPH) if compiled else (None, None)


@dataclass(frozen=True)
class StackFacts:
    has_python: bool           # any Python source frame (analyzer.core.stacks.is_python_frame), torch's too
    phase: str | None          # what torch frames say, or None
    phase_signal: str | None
    module: str | None         # the module call path "Outer › Inner" (analyzer.attribute.module_paths), or None
    call_path: CallPath = ()   # its levels, outermost first
    has_native: bool = False   # any C++ frame: the recording kept them (stacks="all")
    replicates: bool = False   # made by nn.DataParallel's replicate: a copy of the module's parameters
    init_site: str | None = None  # 'file:line' of the user object's __init__ that made it, not a torch.nn module's
    compiled: bool = False     # it runs torch.compile's output (a compiled graph or its runtime wrappers)
    outside_modules: bool = False  # its Python frames reach the program's top and none runs a module (ran_no_module)
    moved_by: str | None = None    # the model a `Module.to`/`.cuda()` moved, by the line that called it (moved_model)
    built_by: str | None = None    # the model a constructor built, by the line that called it (built_model)
    workspace: bool = False    # a C++ frame shows torch's cuBLAS / cuBLASLt handle pool making its workspace


_NN_CONSTRUCTION = ("torch/nn/", "torch\\nn\\")
_REPLICATE = ("torch/nn/parallel/replicate.py", "torch\\nn\\parallel\\replicate.py")
# torch's BLAS handle pool (aten/src/ATen/cuda/CublasHandlePool.cpp) allocates one workspace per handle and stream
# through the caching allocator at the first matmul (`getNewWorkspace`, `getCUDABlasLtWorkspace`) and keeps it
_WORKSPACE = re.compile(r"\bat::cuda::\w*[Ww]orkspace\w*\(")


# what one frame says, as bits, found once per distinct frame (FrameMemo): a stack's facts are then its frames'
# bits or-ed together, and the scans that need the frames' order run only on stacks holding a frame they look for
_PYTHON, _NATIVE, _REPLICATES, _COMPILED, _WORKSPACE_BIT, _RULE = 1, 2, 4, 8, 16, 32
_NN_BUILT, _INIT, _USER, _BUILDS, _APPLIES, _TOP, _IN_MODULE, _LEVEL = 64, 128, 256, 512, 1024, 2048, 4096, 8192
_MODULE = 16384   # a frame of nn.Module itself (torch/nn/modules/module.py)

#: distinct frame -> (its bits, its phase rule); one per attribution, so that 3,000 stacks sharing 1,500 frames
#: look at 1,500 frames, not 4.5 million (issue 37: 100 s of CPU for a 51 KB snapshot)
FrameMemo = dict[Frame, tuple[int, "_Rule | None"]]


def _frame_facts(frame: Frame) -> tuple[int, _Rule | None]:
    filename, _, function = frame
    python, user, rule = is_python_frame(frame), is_user_frame(frame), _rule_of(filename, function)
    bits = ((python and _PYTHON) | (not filename.endswith(".py") and "::" in function and _NATIVE)
            | (filename.endswith(_REPLICATE) and _REPLICATES)
            | (rule is not None and (_RULE | (rule.kind == "compiled" and _COMPILED)))
            | (_WORKSPACE.search(function) is not None and _WORKSPACE_BIT)
            | (any(part in filename for part in _NN_CONSTRUCTION) and _NN_BUILT)
            | (function == "__init__" and filename.endswith(".py") and _INIT)
            | (user and _USER) | (user and _CONSTRUCTION.search(function) is not None and _BUILDS)
            | (_MODULE_PY.search(filename) is not None and (_MODULE | (function == "_apply" and _APPLIES)))
            | (python and function == "<module>" and _TOP)
            | (python and (function in _MODULE_METHODS or _MODULE_MACHINERY.search(filename) is not None)
               and _IN_MODULE)
            | (function in ("forward", "__init__") and _LEVEL))
    return bits, rule


def _bits(frames: tuple[Frame, ...], memo: FrameMemo) -> list[int]:
    facts = [memo.get(f) or memo.setdefault(f, _frame_facts(f)) for f in frames]
    return [b for b, _ in facts]


def _any(bits: list[int]) -> int:
    seen = 0
    for b in bits:
        seen |= b
    return seen


def stack_facts(frames: tuple[Frame, ...], sources: SourceIndex | None = None,
                memo: FrameMemo | None = None) -> StackFacts:
    memo = {} if memo is None else memo
    bits = _bits(frames, memo)
    seen = _any(bits)
    phase, signal = _phase_of(frames, memo) if seen & _RULE else (None, None)
    path = call_path(frames, sources) if seen & _LEVEL else ()
    module = path_label(path) if path else None
    if phase is None and module is not None:
        phase, signal = Phase.FORWARD.value, "frames:user-forward"
    return StackFacts(bool(seen & _PYTHON), phase, signal, module, path, has_native=bool(seen & _NATIVE),
                      replicates=bool(seen & _REPLICATES),
                      init_site=_init_site(frames) if seen & _INIT and not seen & _NN_BUILT else None,
                      compiled=bool(seen & _COMPILED), outside_modules=_outside(seen),
                      moved_by=_moved(frames, bits) if seen & _APPLIES else None,
                      built_by=_built(frames, bits) if seen & _BUILDS else None,
                      workspace=bool(seen & _WORKSPACE_BIT))


_CONSTRUCTION = re.compile(_CONSTRUCTION_FUNCTION)
_MODULE_PY = re.compile(_MODULE_FILE)
# Module's methods that copy every parameter to a device or dtype (`_apply` does it for all of them)
_MOVES = frozenset(("_apply", "convert", "to", "cuda", "xpu", "cpu", "half", "float", "double", "bfloat16", "type",
                    "to_empty"))


def moved_model(frames: tuple[Frame, ...]) -> str | None:
    """`client.py:176 reset_model (Module.to)`: the model whose parameters a `Module.to` (`.cuda()`, `.half()` ...)
    copied, named by the line of user code that called it (a library's wrapper of the same name, such as
    transformers' `PreTrainedModel.to`, is skipped); None when no module's `_apply` made the tensor."""
    return _moved(frames, _bits(frames, {}))


def _moved(frames: tuple[Frame, ...], bits: list[int]) -> str | None:
    applied = [i for i, b in enumerate(bits) if b & _APPLIES]
    if not applied:
        return None
    outer = applied[-1] + 1
    method = "to"
    while outer < len(frames) and frames[outer][2] in _MOVES:
        method = frames[outer][2] if bits[outer] & _MODULE else method
        outer += 1
    return _called_at(frames, bits, outer, f"Module.{method}")


def built_model(frames: tuple[Frame, ...]) -> str | None:
    """`flex_opt.py:1231 run_flexgen (__init__)`: the model whose construction made a tensor, named by the line of
    user code that called its outermost constructor (or `from_pretrained`, `init_weights` ...) in the user's
    code; None when no such frame made it. Where the classes are readable, the constructors' call path says
    more (analyzer.attribute.module_paths); this names the model where they are not (another version's files,
    a library's hand-written layers such as FlexGen's)."""
    return _built(frames, _bits(frames, {}))


def _built(frames: tuple[Frame, ...], bits: list[int]) -> str | None:
    built = [i for i, b in enumerate(bits) if b & _BUILDS]
    return _called_at(frames, bits, built[-1] + 1, frames[built[-1]][2]) if built else None


def _called_at(frames: tuple[Frame, ...], bits: list[int], outer: int, how: str) -> str | None:
    """'file:line function (how)' of the first user frame from `outer` outward, or None."""
    site = next((i for i in range(outer, len(frames)) if bits[i] & _USER), None)
    return f"{format_frame(frames[site])} ({how})" if site is not None else None


# frames that run a module, or code a module's work runs in: torch's module machinery (`_call_impl`, hooks,
# `Module.to`), its wrappers (DDP, FSDP), autograd (a backward is the modules' backward), activation
# checkpointing, torch.compile and its generated code, FX graph modules
_MODULE_MACHINERY = re.compile(_MODULE_FILE + "|" + _T + r"(nn[\\/]parallel[\\/]|distributed[\\/]|autograd[\\/]|"
                               r"utils[\\/]checkpoint\.py$|_dynamo[\\/]|_inductor[\\/]|_functorch[\\/]|"
                               r"_higher_order_ops[\\/]|fx[\\/])|(^|[\\/])torchinductor_[^\\/]*[\\/]")
_MODULE_METHODS = frozenset(("forward", "__init__", "backward"))


def ran_no_module(frames: tuple[Frame, ...]) -> bool:
    """Whether the stack shows that no module was running: it has Python frames up to the program's top level
    (a `<module>` frame: a script, a notebook cell, `python -m`), and none of them is a `forward`, a constructor,
    a `backward` or torch's module machinery. A stack that stops short of the top (a thread's, autograd's) or
    runs a module somewhere proves nothing."""
    return _outside(_any(_bits(frames, {})))


def _outside(seen: int) -> bool:
    return bool(seen & _TOP and not seen & _IN_MODULE)


def _init_site(frames: tuple[Frame, ...]) -> str | None:
    """'file:line' of the innermost user `__init__` that made a tensor; asked only of a stack where no torch.nn
    module's construction did (a module's own parameters, not an object's state per parameter)."""
    return next((f"{file}:{line}" for file, line, function in frames if function == "__init__"
                 and file.endswith(".py") and "torch" not in file.replace("\\", "/").split("/")), None)
