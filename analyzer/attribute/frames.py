"""What a stack says about an allocation: the phase its torch frames reveal and the module whose forward
made it. Evaluated once per distinct stack, never per allocation."""
from __future__ import annotations

import ast
import os
import re
import stat
from dataclasses import dataclass
from functools import lru_cache

from analyzer.core.stacks import Frame, format_frame, is_user_frame
from analyzer.core.vocabulary import Phase

# (pattern on "file function", phase, signal name), checked innermost frame first; the first match wins
_PHASE_RULES: list[tuple[re.Pattern[str], str, str]] = [
    (re.compile(r"torch[\\/]utils[\\/]checkpoint\.py "), Phase.BACKWARD.value, "frames:activation-checkpoint-recompute"),
    (re.compile(r"torch[\\/](_tensor\.py backward|autograd[\\/])"), Phase.BACKWARD.value, "frames:torch.autograd"),
    (re.compile(r"torch[\\/]optim[\\/]"), Phase.OPTIMIZER.value, "frames:torch.optim"),
    (re.compile(r"torch[\\/](serialization\.py (save|_save)|distributed[\\/]checkpoint[\\/])"),
     Phase.CHECKPOINT_SAVE.value, "frames:torch.save"),
    (re.compile(r" (state_dict|_save_to_state_dict|full_state_dict|get_state_dict|consolidate_state_dict)$"),
     Phase.CHECKPOINT_SAVE.value, "frames:state_dict"),
    (re.compile(r"torch[\\/]serialization\.py (load|_load)|load_state_dict$|_load_from_state_dict$"), Phase.LOAD.value,
     "frames:load_state_dict"),
    (re.compile(r"torch[\\/]nn[\\/]modules[\\/]module\.py (_apply|to|cuda|convert)$"), Phase.LOAD.value, "frames:module.to"),
    (re.compile(r"torch[\\/]nn[\\/](modules[\\/]\w+\.py (__init__|reset_parameters)|init\.py \w+)$"), Phase.LOAD.value,
     "frames:module-init"),
    (re.compile(r"torch[\\/]_dynamo[\\/]|torch[\\/]_inductor[\\/]"), Phase.COMPILE.value, "frames:torch.compile"),
    (re.compile(r"torch[\\/]nn[\\/]modules[\\/]module\.py (_call_impl|_wrapped_call_impl)$"), Phase.FORWARD.value,
     "frames:module.forward"),
    (re.compile(r" \w*(save|state_dict|consolidate)\w*$", re.IGNORECASE), Phase.CHECKPOINT_SAVE.value,
     "frames:user-function-name"),
    (re.compile(r" (__init__|\w*(init_weight|init_all_weights|load_model|load_weights|load_checkpoint|from_pretrained)\w*)$"),
     Phase.LOAD.value, "frames:model-construction"),
]


@dataclass(frozen=True)
class StackFacts:
    has_python: bool
    phase: str | None          # what torch frames say, or None
    phase_signal: str | None
    module: str | None         # "Class.forward" (or "file:line forward") of the innermost user forward frame


def stack_facts(frames: tuple[Frame, ...]) -> StackFacts:
    has_python = any(f[0].endswith(".py") for f in frames)
    phase = signal = None
    for filename, _, function in frames:
        text = f"{filename} {function}"
        for pattern, rule_phase, rule_signal in _PHASE_RULES:
            if pattern.search(text):
                phase, signal = rule_phase, rule_signal
                break
        if phase:
            break
    module = next((resolve_method(f) for f in frames if is_user_frame(f) and f[2] == "forward"), None)
    if phase is None and module is not None:
        phase, signal = Phase.FORWARD.value, "frames:user-forward"
    return StackFacts(has_python, phase, signal, module)


_MAX_SOURCE_BYTES = 4 << 20  # no real source file is larger; bigger ones are not read


@lru_cache(maxsize=4096)
def _classes_by_line(filename: str) -> tuple[tuple[int, int, str], ...]:
    """(first line, last line, class name) of every class in a readable source file; empty otherwise.

    The file name comes from the input, so it is untrusted: only a regular file of at most _MAX_SOURCE_BYTES
    is read (opened without blocking and checked with fstat, so a frame naming /dev/zero, a FIFO or a huge
    file can neither exhaust memory nor block the analysis)."""
    try:
        fd = os.open(filename, os.O_RDONLY | os.O_NONBLOCK)
        with open(fd, "rb") as source:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return ()
            data = source.read(_MAX_SOURCE_BYTES + 1)
        if len(data) > _MAX_SOURCE_BYTES:
            return ()
        tree = ast.parse(data.decode("utf-8", errors="replace"))
    except (OSError, SyntaxError, ValueError, RecursionError, MemoryError):
        return ()
    return tuple((node.lineno, node.end_lineno or node.lineno, node.name)
                 for node in ast.walk(tree) if isinstance(node, ast.ClassDef))


def resolve_method(frame: Frame) -> str:
    """'Class.method' when the source file is readable here, else 'file:line function'."""
    filename, line, function = frame
    enclosing = [c for c in _classes_by_line(filename) if c[0] <= line <= c[1]]
    if enclosing:
        innermost = max(enclosing, key=lambda c: c[0])
        return f"{innermost[2]}.{function}"
    return format_frame(frame)
