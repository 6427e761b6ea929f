"""Which frame of a stack a person should read: the innermost one that is their code, not torch's or C++'s."""
from __future__ import annotations

import re

Frame = tuple[str, int, str]  # (filename, line, function)

# torch itself (paths are relative in Kineto stacks), C++ frames from the unwinder, the interpreter's own machinery and the stdlib plumbing
_NOT_USER = re.compile(
    r"(^\?\?$|^<|(^|[\\/])torch[\\/]|[\\/]torch$|\.(cpp|cc|h|hpp|cu)$|[\\/]python3\.\d+[\\/](contextlib|threading|runpy|functools|abc)\.py$)"
)


def is_user_frame(frame: Frame) -> bool:
    filename = frame[0]
    return bool(filename) and not _NOT_USER.search(filename)


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
    """'file:line function' of the innermost user frame (frames are innermost first), or None."""
    for frame in frames:
        if is_user_frame(frame):
            return format_frame(frame)
    return None
