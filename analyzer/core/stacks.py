"""Which frame of a stack a person should read: the innermost Python frame of their own code, never a C/C++
frame, torch's or the interpreter's; and which ATen operator the C++ frames say made the allocation.

A snapshot recorded with `stacks="all"` (torch >= 2.1's default) interleaves C++ frames (file names such as
'??', '', 'Foo.cpp', 'thread48.o', 'Objects/methodobject.c', line 0 or the interpreter's own C lines) with
the CPython frames. Only a Python source frame can be the allocating site; the C++ frames still say which
operator ran (`at::_ops::NAME::call`), kept as the allocation's op."""
from __future__ import annotations

import re

Frame = tuple[str, int, str]  # (filename, line, function)

_PYTHON_SUFFIXES = (".py", ".pyw")
# code the interpreter ran from a string: a notebook or REPL cell (<ipython-input-3-ab12>, <stdin>) and torch's
# or the stdlib's generated code (<eval_with_key>.7, <string>, <frozen importlib._bootstrap>); Kineto's
# `<built-in>` stands for a C function, not Python
_PSEUDO_FILE = re.compile(r"<(?!built-in>)[^<>]*>")
_USER_CELL = re.compile(r"<(ipython-input-[^<>]*|stdin)>")
# Python frames that are plumbing, not the user's code: torch itself (Kineto's paths are relative), triton, the
# code torch.compile generates (under its cache directory, default /tmp/torchinductor_USER), and the standard
# library (lib/python3.N/ outside site-packages; on Windows …\PythonNN\Lib\ or …\cpython-3.N…\lib\)
_PLUMBING = re.compile(
    r"(^|[\\/])(torch|functorch|triton)[\\/]"
    r"|(^|[\\/])torchinductor_[^\\/]*[\\/]"
    r"|[\\/]lib[\\/]python\d+(\.\d+)?t?[\\/](?!(site|dist)-packages[\\/])"
    r"|python[^\\/]*\\lib\\(?!site-packages\\)",
    re.IGNORECASE,
)


def is_python_frame(frame: Frame) -> bool:
    """A frame of Python source: a `.py` file, or code run from a string (a notebook cell, `<string>` ...)."""
    filename = frame[0]
    return filename.lower().endswith(_PYTHON_SUFFIXES) or bool(_PSEUDO_FILE.match(filename))


def is_user_frame(frame: Frame) -> bool:
    """A Python frame of the user's code (their files, notebook cells and the libraries they call), not torch's,
    triton's, torch.compile's generated code or the standard library's."""
    filename = frame[0]
    if filename.startswith("<"):
        return bool(_USER_CELL.fullmatch(filename))
    return is_python_frame(frame) and not _PLUMBING.search(filename)


def format_frame(frame: Frame) -> str:
    filename, line, function = frame
    return f"{filename}:{line} {function}"


def short_frame(text: str, parts: int = 3) -> str:
    """'…/train/models.py:174 update_nodes' from a full 'file:line function': the end of a path says the most."""
    location, _, function = text.partition(" ")
    pieces = location.replace("\\", "/").split("/")
    shortened = "/".join(pieces[-parts:])
    return (("…/" if len(pieces) > parts else "") + shortened + (" " + function if function else "")).strip()


def top_user_frame(frames: tuple[Frame, ...]) -> str | None:
    """'file:line function' of the innermost user frame (frames are innermost first); None when the stack has
    none (C++ frames only, or only torch's): a C frame is never the site."""
    for frame in frames:
        if is_user_frame(frame):
            return format_frame(frame)
    return None


_OPS_FRAME = re.compile(r"at::_ops::(\w+)::(?:call|redispatch)\(")   # the dispatcher's entry of one operator
_NATIVE_FRAME = re.compile(r"at::native::(\w+)\(")                    # a kernel, where no dispatcher frame is
_ALLOCATION_ONLY = re.compile(r"(new_)?empty(_\w+)?")                 # makes the output of the op that called it


def stack_op(frames: tuple[Frame, ...]) -> str | None:
    """'aten::NAME' of the operator whose C++ frames made the allocation, or None (no C++ frames recorded).

    The innermost operator called below the innermost Python frame, passing over the `empty*` ops that only
    allocate the output of the op that called them (`aten::empty_strided` inside `aten::_to_copy` is the
    copy's); where every op is one of those, the outermost (the one the caller asked for). NAME is the
    dispatcher's: the operator and its overload joined by '_' (`sum_dim_IntList` is aten::sum.dim_IntList)."""
    c_frames = []
    for frame in frames:
        if is_python_frame(frame):
            break
        c_frames.append(frame[2])
    for pattern in (_OPS_FRAME, _NATIVE_FRAME):
        ops = [m[1] for name in c_frames if (m := pattern.match(name))]
        if ops:
            return "aten::" + next((op for op in ops if not _ALLOCATION_ONLY.fullmatch(op)), ops[-1])
    return None
